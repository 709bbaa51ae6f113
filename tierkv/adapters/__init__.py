"""Engine adapters. Each lives in its own subpackage and imports its engine lazily."""
