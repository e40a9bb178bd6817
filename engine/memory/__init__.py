"""The memory plan: a ledger of every byte the worker will use on its device."""
