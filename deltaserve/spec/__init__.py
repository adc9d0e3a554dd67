"""Speculative decoding: the proposer interface and methods (proposer.py, ngram.py, dflash/),
`speculative_config` (config.py, registry.py), draft acceptance by rejection sampling
(acceptance.py), GDN state rollback after a verify step (gdn_rollback.py) and the engine's
speculative step (spec_step.py). docs/architecture.md, "Speculative decoding", is the map."""
