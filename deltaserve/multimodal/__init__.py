"""Image inputs: loading media for requests (media.py) and chat content parts (chat_parts.py);
preprocessing through the checkpoint's transformers image processor, the per-request multimodal
record (placeholder ranges, M-RoPE positions, content hashes) and the encoder output cache. The
vision tower itself is math in deltaserve/models/qwen3_5_vision.py."""
