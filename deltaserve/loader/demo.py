"""The embedded demo model: a tiny Qwen3.5-shaped checkpoint built locally, with random weights.

`ensure_demo_model()` writes a complete HF-format model directory (config.json,
generation_config.json, tokenizer.json, tokenizer_config.json, model.safetensors, README.md)
into the user cache, deterministically and without any download, so that
`deltaserve generate "Hello"` runs on a fresh machine. Its text is noise: the point is to
exercise the whole engine (hybrid GDN + gated attention layers, byte-level tokenizer, ChatML
template) on real on-disk formats, not to say anything sensible.

NOTE: the output is a function of this file and the installed transformers version only. Any
change to the recipe must bump `DEMO_MODEL_NAME`, so that stale caches are never reused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path

from deltaserve import env

DEMO_MODEL_NAME = "demo-qwen3.5-v1"
DEMO_NOTICE = (
    "deltaserve demo model: tiny Qwen3.5-shaped model with RANDOM weights; its text is noise."
)
DEMO_SEED = 20250101

_COMPLETE_MARKER = ".deltaserve-demo-complete"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "README.md",
    _COMPLETE_MARKER,
)

# Special tokens, in id order after the 256 byte tokens. `<think>` / `</think>` are plain added
# tokens (not special), as in Qwen3, so that they survive `skip_special_tokens=True`.
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_ADDED_TOKENS = ("<think>", "</think>")
_EOS_TOKEN = "<|im_end|>"
_PAD_TOKEN = "<|endoftext|>"

# Shape of the tiny model. 4 layers: 3 Gated DeltaNet layers, then 1 gated full-attention layer.
_HIDDEN = 128
_PRINTABLE_BYTES = (9, 10, *range(32, 127))  # byte token ids: tab, newline, printable ASCII
_LAYER_TYPES = ("linear_attention",) * 3 + ("full_attention",)

# ChatML, Qwen3-style: system / user / assistant / tool roles, optional tools in the system turn,
# `enable_thinking=False` pre-fills an empty think block after the generation prompt.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nFunction signatures, one per line, inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply with <tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('Only the first message may be a system message.') -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' + render_content(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\n<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unknown chat role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

_README = f"""# {DEMO_MODEL_NAME}

{DEMO_NOTICE}

Built locally by `deltaserve.loader.demo.ensure_demo_model()` (no download). The weights are
RANDOM, drawn from a fixed seed ({DEMO_SEED}); the model has never been trained, so whatever it
generates is noise. It exists to run the engine end to end: 3 Gated DeltaNet layers + 1 gated
full-attention layer (Qwen3.5 layout, loadable by transformers' `Qwen3_5ForCausalLM`), a
byte-level BPE tokenizer with no merges, and a ChatML chat template.

Delete this directory to have it rebuilt.
"""


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Return the demo model directory, building it first if it is missing or incomplete.

    `cache_dir` is the cache root (default: `deltaserve.env.cache_dir()`, i.e.
    $DELTASERVE_CACHE_DIR, else $XDG_CACHE_HOME/deltaserve, else ~/.cache/deltaserve); the model
    lives in its `DEMO_MODEL_NAME` subfolder. The directory is built in a temporary sibling and
    renamed into place, so a reader never sees a half-written model, and concurrent builders are
    safe (the first rename wins, the others discard their copy).
    """
    root = Path(cache_dir if cache_dir is not None else env.cache_dir()).expanduser()
    target = root / DEMO_MODEL_NAME
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.tmp-", dir=root))
    try:
        build_demo_model(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_demo_model(out_dir: str | Path) -> None:
    """Write every file of the demo model into the existing, empty directory `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer = _build_tokenizer()
    # NOTE: save_jinja_files=False keeps the chat template inside tokenizer_config.json, where
    # every loader (old transformers, vLLM, ours) looks for it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)

    eos_id = tokenizer.convert_tokens_to_ids(_EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(_PAD_TOKEN)
    vocab_size = _round_up(len(tokenizer), 8)
    config = _build_config(vocab_size, eos_id)
    config.save_pretrained(out_dir)

    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id).save_pretrained(out_dir)

    from safetensors.torch import save_file

    save_file(_build_weights(config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "README.md").write_text(_README, encoding="utf-8")
    for path in out_dir.iterdir():
        os.chmod(path, 0o644)  # safetensors writes 0600
    (out_dir / _COMPLETE_MARKER).write_text(DEMO_MODEL_NAME + "\n", encoding="utf-8")


def _is_complete(model_dir: Path) -> bool:
    return model_dir.is_dir() and all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` to `target`, replacing an incomplete `target` if there is one."""
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if _is_complete(target):  # another process finished first; use its copy
            return
    # `target` exists but is incomplete (interrupted by hand, or files deleted): move it aside.
    stale = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.stale-", dir=target.parent))
    try:
        os.rename(target, stale / "model")
    except FileNotFoundError:
        pass
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, used by byte-level BPE."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _build_tokenizer():
    """Byte-level BPE over the 256 byte tokens (ids 0..255 = byte values), no merges, plus the
    chat special tokens at ids 256.. in `_SPECIAL_TOKENS + _ADDED_TOKENS` order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _byte_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=_EOS_TOKEN,
        pad_token=_PAD_TOKEN,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _build_config(vocab_size: int, eos_id: int):
    """The Qwen3.5 text config of the demo model (architecture `Qwen3_5ForCausalLM`)."""
    from transformers import Qwen3_5TextConfig

    head_dim = 32
    partial_rotary_factor = 0.25
    rotary_half = int(head_dim * partial_rotary_factor) // 2  # 4 frequencies
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=_HIDDEN,
        intermediate_size=256,
        num_hidden_layers=len(_LAYER_TYPES),
        layer_types=list(_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": partial_rotary_factor,
            # Text-only positions make M-RoPE plain RoPE; the sections still sum to the number
            # of rotary frequencies, as in the real checkpoints ([11, 11, 10] for 32).
            "mrope_section": [rotary_half - 2, 1, 1],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
        dtype="float32",
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def _build_weights(config) -> dict:
    """Every persistent weight of transformers' `Qwen3_5ForCausalLM(config)`, filled randomly.

    Names and shapes come from the HF model built on the meta device. Each tensor is drawn from
    its own generator, seeded from `DEMO_SEED` and the tensor's name, so values do not depend on
    the order of the other parameters.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)

    weights = {}
    for name in sorted(shapes):
        gen = torch.Generator().manual_seed(DEMO_SEED ^ zlib.crc32(name.encode()))
        weights[name] = _init_tensor(name, shapes[name], gen).contiguous()
    return weights


def _init_tensor(name: str, shape: tuple[int, ...], gen):
    """A random value for one named weight. Every weight is randomised, norms included: a
    zero-centred norm left at 0 would hide a missing `1 + w` in an implementation."""
    import torch

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    if name.endswith(".A_log"):  # GDN decay rate A = exp(A_log), A in [1, 16)
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith(".dt_bias"):
        return normal(0.1, mean=1.0)
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain weight, centred on 1
        return normal(0.1, mean=1.0)
    if name.endswith("norm.weight"):  # Qwen3.5 RMSNorm: zero-centred, scales by (1 + w)
        return normal(0.1)
    if name.endswith("conv1d.weight"):  # depthwise causal conv, [conv_dim, 1, kernel]
        return normal(shape[-1] ** -0.5)
    if name.endswith("embed_tokens.weight"):  # also the (tied) lm_head, [vocab, hidden]
        # NOTE: rows of printable ASCII bytes (and tab, newline) get 4x the norm of the others,
        # so the tied lm_head favours them and the noise is readable. Every token, specials and
        # padding rows included, keeps a nonzero row and stays reachable by sampling.
        row_scale = torch.full((shape[0], 1), 0.25)
        row_scale[list(_PRINTABLE_BYTES)] = 1.0
        return normal(0.2) * row_scale
    if name.endswith(".weight") and len(shape) == 2:  # nn.Linear [out, in]
        # Big enough that each layer's output outweighs the token's own embedding in the
        # residual stream (smaller scales make greedy decoding repeat the last token).
        return normal(1.5 * shape[1] ** -0.5)
    raise ValueError(f"demo model: no init rule for weight {name!r} of shape {shape}")
