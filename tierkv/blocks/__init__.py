"""The block's life in the primary: the pool's slots, the ledger that is their one writer, admission
(requests, pins, leases, the queue for slots), eviction policies, hybrid prefix rules, and the slot
API an engine adapter copies blocks through."""
