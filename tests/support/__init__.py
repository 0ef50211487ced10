"""Helpers shared by the test suite: local services, fault injection and relay subprocesses.

Nothing here imports `relay`, so these helpers work (and are self-tested) on their own.
"""
