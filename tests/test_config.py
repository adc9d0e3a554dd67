"""Engine configuration: validation with clear messages, "auto" resolution."""

import json

import pytest
import torch

from deltaserve.config import create_engine_config, resolve_dtype


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import Qwen3Config

    d = tmp_path_factory.mktemp("cfg")
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(d)
    return d


def test_auto_resolution_on_cpu(ckpt):
    cfg = create_engine_config(str(ckpt), device="cpu")
    assert cfg.model.dtype == torch.float32
    assert cfg.model.max_model_len == 128  # from max_position_embeddings
    assert cfg.model.architecture == "Qwen3ForCausalLM"
    assert cfg.scheduler.max_num_batched_tokens >= 1
    assert cfg.kv_cache_memory_bytes is None
    # GiB below 1024, bytes from 1024 (as --prefix-state-memory)
    assert (
        create_engine_config(
            str(ckpt), device="cpu", kv_cache_memory_bytes=1.5
        ).kv_cache_memory_bytes
        == 3 * 2**29
    )
    assert (
        create_engine_config(
            str(ckpt), device="cpu", kv_cache_memory_bytes=4096
        ).kv_cache_memory_bytes
        == 4096
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_model_len": 4096}, "exceeds the model's max_position_embeddings"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"dtype": "int8"}, "unsupported dtype"),
        ({"device": "tpu"}, "unsupported device"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "without chunked"),
        ({"state_dtype": "float16"}, "state_dtype"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be > 0"),
        ({"kv_cache_memory_bytes": "lots"}, "kv_cache_memory_bytes must be a number"),
    ],
)
def test_bad_settings_fail_clearly(ckpt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_engine_config(str(ckpt), **{"device": "cpu", **kwargs})


def test_missing_dir_and_unsupported_architecture(ckpt, tmp_path):
    with pytest.raises(ValueError, match="not found"):
        create_engine_config(str(tmp_path / "nope"))
    raw = json.loads((ckpt / "config.json").read_text())
    raw["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="supported: .*Qwen3ForCausalLM"):
        create_engine_config(str(tmp_path))


def test_dtype_auto_prefers_checkpoint_half_dtype_on_gpu():
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", torch.float16, cuda) == torch.float16
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.bfloat16
    assert resolve_dtype("auto", torch.float32, cuda) == torch.bfloat16
    assert resolve_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.float32


def test_backends_by_dict_and_by_keyword(ckpt):
    cfg = create_engine_config(
        str(ckpt),
        device="cpu",
        backends={"attention": "torch", "fused": "auto"},
        decode_gemm_backend="torch",
        gdn_decode_backend="auto",
    )
    assert cfg.backends == {"attention": "torch", "decode_gemm": "torch"}  # "auto" dropped
    assert cfg.forced_backends == {
        "attention": "torch",
        "gdn_prefill": "auto",
        "gdn_decode": "auto",
        "gdn_replay": "auto",
        "conv1d": "auto",
        "fused": "auto",
        "decode_gemm": "torch",
        "moe": "auto",
        "mla": "auto",
    }
    # the same choice both ways is fine
    same = create_engine_config(
        str(ckpt), device="cpu", backends={"attention": "torch"}, attention_backend="torch"
    )
    assert same.backends == {"attention": "torch"}
    assert create_engine_config(str(ckpt), device="cpu").backends == {}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"backends": {"gdn": "torch"}},
            ValueError,
            r"unknown op family 'gdn'; known: attention, gdn_prefill, gdn_decode, gdn_replay, "
            "conv1d, fused, decode_gemm",
        ),
        (
            {"attention_backend": "cuda"},
            ValueError,
            r"unknown attention backend 'cuda'; choose from auto, flashinfer, triton, torch",
        ),
        (
            {"backends": {"gdn_prefill": "flashinfer"}},
            ValueError,
            r"unknown gdn_prefill backend 'flashinfer'; choose from auto, fla, triton, torch",
        ),
        ({"gdn_backend": "torch"}, TypeError, r"'gdn_backend' \(the backend keywords are "),
        ({"max_num_seq": 4}, TypeError, r"unexpected keyword argument 'max_num_seq'"),
        (
            {"backends": {"attention": "torch"}, "attention_backend": "triton"},
            ValueError,
            r"attention backend given twice: 'torch' and attention_backend='triton'",
        ),
    ],
)
def test_bad_backend_choices_fail_clearly(ckpt, kwargs, error, match):
    with pytest.raises(error, match=match):
        create_engine_config(str(ckpt), device="cpu", **kwargs)


def test_engine_config_validates_backends_on_construction(ckpt):
    from dataclasses import replace

    cfg = create_engine_config(str(ckpt), device="cpu")
    assert replace(cfg, backends={"conv1d": "triton", "fused": "auto"}).backends == {
        "conv1d": "triton"
    }
    with pytest.raises(ValueError, match="unknown op families 'gdn', 'ssm'; known: attention"):
        replace(cfg, backends={"gdn": "torch", "ssm": "torch"})
