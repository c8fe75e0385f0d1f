"""A model version's way from written to served: evaluation on held-out data, promotion gates.

Importing this package does no I/O and loads no model.
"""
