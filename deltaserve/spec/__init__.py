"""Speculative decoding: proposers (DFlash drafter, n-gram), verification and rollback."""
