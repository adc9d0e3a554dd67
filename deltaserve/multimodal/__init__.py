"""Image inputs: preprocessing through the checkpoint's transformers image processor, the
per-request multimodal record (placeholder ranges, M-RoPE positions, content hashes) and the
encoder output cache. The vision tower itself is math in deltaserve/models/qwen3_5_vision.py."""
