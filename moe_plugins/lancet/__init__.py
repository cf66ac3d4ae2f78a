"""Lancet: weight-gradient and non-MoE computation overlapped with the MoE all-to-all. docs/lancet.md explains it.
"""
