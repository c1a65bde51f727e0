"""Tables and figures regenerated from the results store (never from hard-coded numbers)."""
