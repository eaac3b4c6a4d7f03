"""Kernel timing database: schema, store, collectors, lookup."""
