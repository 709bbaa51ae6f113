"""Moving blocks between the primary and the lower tiers: lookups and the cost model, promotions,
``get`` and ``put``, cascades down to the tiers, and the gateway that drives each lower tier."""
