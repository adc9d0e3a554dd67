"""The op-family registry is the one place to add a family: flags, keywords, config, selection,
capabilities by layer kind and the CUDA-graph check all follow from it."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

import deltaserve.backends as backends
from deltaserve import cli
from deltaserve.backends import (
    BackendSpec,
    Capabilities,
    OpFamily,
    graph_blocker,
    load_backends,
    select_all,
)
from deltaserve.cache.spec import AttentionSpec, CacheSpec, GDNSpec


@dataclass(frozen=True)
class ToySpec(CacheSpec):
    """A cache kind no code knows about (think MLA's latent)."""

    pool: ClassVar[str] = "paged"
    layer_kind: ClassVar[str] = "toy"

    width: int


def _needs_cuda(caps: Capabilities) -> str | None:
    return None if caps.device.type == "cuda" else "no CUDA device"


TOY = OpFamily(
    "toy_op",
    "toy",
    "a toy op for toy layers",
    (
        BackendSpec("fast", "toy_op", "x:Fast", _needs_cuda),
        BackendSpec("plain", "toy_op", "deltaserve.ops.linear:TorchDecodeGemm"),
    ),
)


@pytest.fixture
def toy_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the registry with one more op family, and no other edit anywhere."""
    monkeypatch.setattr(backends, "OP_FAMILIES", {**backends.OP_FAMILIES, "toy_op": TOY})


def _caps(**kinds) -> Capabilities:
    return Capabilities(torch.device("cpu"), torch.float32, torch.float32, 16, **kinds)


# --- the registry itself -----------------------------------------------------------------------


def test_derived_views_follow_the_registry(toy_registry: None) -> None:
    assert backends.OPS[-1] == "toy_op" and backends.OPS[0] == "attention"
    assert backends.OP_LAYERS["toy_op"] == "toy" and backends.OP_LAYERS["fused"] is None
    assert [b.name for b in backends.REGISTRY["toy_op"]] == ["fast", "plain"]
    assert (TOY.flag, TOY.keyword) == ("--toy-op-backend", "toy_op_backend")


def test_family_declaration_is_checked() -> None:
    with pytest.raises(ValueError, match="declare another op"):
        OpFamily("a", None, "d", (BackendSpec("torch", "b", "x:Y"),))
    with pytest.raises(ValueError, match="must be unique"):
        OpFamily("a", None, "d", (BackendSpec("t", "a", "x:Y"), BackendSpec("t", "a", "x:Z")))
    with pytest.raises(ValueError, match="has no backend"):
        OpFamily("a", None, "d", ())


# --- generated flags and keywords --------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi"],
        ["chat"],
        ["serve"],
        ["backends"],
        ["bench", "throughput"],
    ],
)
def test_toy_family_gets_a_flag_on_every_command(toy_registry: None, argv: list[str]) -> None:
    parser = cli.build_parser()
    args = parser.parse_args([*argv, "--toy-op-backend", "plain", "--attention-backend", "torch"])
    assert args.toy_op_backend == "plain" and args.attention_backend == "torch"
    assert parser.parse_args(argv).toy_op_backend == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--toy-op-backend", "nope"])


def test_toy_flag_help_lists_its_choices(
    toy_registry: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--toy-op-backend {auto,fast,plain}" in out
    assert "a toy op for toy layers: auto, fast, plain (default auto)" in out
    assert "--gdn-decode-backend {auto,triton,flashinfer,torch}" in out


def test_toy_flag_reaches_llm_keywords_and_backend_table(
    toy_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = cli.build_parser().parse_args(["generate", "hi", "--toy-op-backend", "fast"])
    kw = cli.engine_kwargs(args)
    assert kw["toy_op_backend"] == "fast" and kw["attention_backend"] == "auto"
    assert cli.BACKEND_FLAGS["toy-op-backend"] == ["fast", "plain"]
    assert list(cli.BACKEND_FLAGS)[-1] == "toy-op-backend"

    calls = []
    monkeypatch.setattr(backends, "format_backend_table", lambda *a: calls.append(a) or "T")
    assert cli.main(["backends", "--model", "/m", "--toy-op-backend", "plain"]) == 0
    forced = calls[0][3]
    assert forced["toy_op"] == "plain" and forced["attention"] == "auto"


def test_bench_throughput_passes_the_toy_keyword(
    toy_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deltaserve.llm
    from deltaserve.bench import throughput

    created = []
    monkeypatch.setattr(deltaserve.llm, "LLM", lambda model, **kw: created.append(kw))
    args = cli.build_parser().parse_args(
        ["bench", "throughput", "--model", "/m", "--toy-op-backend", "plain"]
    )
    throughput._build_llm(args, 64, 4, 64)
    assert created[0]["toy_op_backend"] == "plain" and created[0]["fused_backend"] == "auto"


def test_toy_keyword_reaches_the_engine_config(toy_registry: None) -> None:
    from deltaserve.config import create_engine_config

    cfg = create_engine_config(
        None,
        random_model="tiny-qwen3.5",
        device="cpu",
        toy_op_backend="plain",
        conv1d_backend="torch",
    )
    assert cfg.backends == {"toy_op": "plain", "conv1d": "torch"}
    assert cfg.forced_backends["toy_op"] == "plain" and cfg.forced_backends["fused"] == "auto"
    cfg = create_engine_config(
        None, random_model="tiny-qwen3.5", device="cpu", backends={"toy_op": "fast"}
    )
    assert cfg.backends == {"toy_op": "fast"}
    with pytest.raises(ValueError, match="unknown toy_op backend 'nope'; choose from auto, fast"):
        create_engine_config(None, random_model="tiny-qwen3.5", device="cpu", toy_op_backend="nope")


# --- selection and capabilities by layer kind --------------------------------------------------


def test_toy_family_is_selected_only_for_models_with_toy_layers(toy_registry: None) -> None:
    assert "toy_op" not in select_all(_caps(attention=(AttentionSpec(4, 2, 64),)))
    decisions = select_all(_caps(toy=(ToySpec(8),)))
    assert set(decisions) == {"toy_op", "fused", "decode_gemm"}
    assert decisions["toy_op"].chosen.name == "plain"
    assert decisions["toy_op"].passed_over == (("fast", "no CUDA device"),)
    with pytest.raises(ValueError, match="cannot serve this model: no CUDA device"):
        select_all(_caps(toy=(ToySpec(8),)), {"toy_op": "fast"})


def test_capabilities_group_specs_by_layer_kind() -> None:
    attn, gdn = AttentionSpec(4, 2, 64), GDNSpec(2, 4, 16, 24, 4)
    specs = [gdn, attn, ToySpec(8), gdn, ToySpec(16), ToySpec(8), attn]
    caps = Capabilities.from_specs(specs, torch.device("cpu"), torch.float32, torch.float32, 16)
    assert caps.attention == (attn,) and caps.gdn == (gdn,)  # distinct, in layer order
    assert caps.specs("toy") == (ToySpec(8), ToySpec(16))
    assert caps.specs("mla") == ()
    # the same capabilities built by hand (positional attention / gdn, any other kind by name)
    same = Capabilities(
        torch.device("cpu"),
        torch.float32,
        torch.float32,
        16,
        [attn],
        [gdn],
        toy=[ToySpec(8), ToySpec(16)],
    )
    assert same == caps and hash(same) == hash(caps)
    attention_only = Capabilities.from_specs(
        [attn], torch.device("cpu"), torch.float32, torch.float32, 16
    )
    assert attention_only.gdn == () and attention_only.specs("toy") == ()
    assert attention_only != caps


# --- CUDA graphs -------------------------------------------------------------------------------


def _backend(name: str, graphable: bool) -> SimpleNamespace:
    return SimpleNamespace(name=name, supports_cuda_graph=graphable)


def test_graph_blocker_names_the_first_backend_that_cannot_be_captured() -> None:
    ok = {op: _backend("fast", True) for op in backends.OP_FAMILIES}
    assert graph_blocker(ok) is None
    assert graph_blocker({**ok, "gdn_decode": _backend("slow", False)}) == (
        "gdn_decode backend slow cannot be captured in a CUDA graph"
    )
    assert graph_blocker({**ok, "fused": _backend("eager", False)}) == (
        "fused backend eager cannot be captured in a CUDA graph"
    )
    # prefills run eagerly: a gdn_prefill backend never blocks capture
    assert graph_blocker({**ok, "gdn_prefill": _backend("torch", False)}) is None
    # a family the model does not use is absent (or None)
    assert graph_blocker({"attention": _backend("fast", True), "gdn_decode": None}) is None
    # an undeclared backend, or one of an unknown family, counts as unable
    assert graph_blocker({"attention": object()}) == (
        "attention backend object cannot be captured in a CUDA graph"
    )
    assert graph_blocker({"mystery": _backend("m", False)}) == (
        "mystery backend m cannot be captured in a CUDA graph"
    )


def test_graph_blocker_on_the_loaded_torch_backends() -> None:
    from deltaserve.cache.spec import MLASpec
    from deltaserve.ops.moe import MoESpec

    caps = _caps(
        attention=(AttentionSpec(4, 2, 64),),
        gdn=(GDNSpec(2, 4, 16, 24, 4),),
        moe=(MoESpec(8, 2, 64, 32),),
        mla=(MLASpec(4, 32, 16),),
    )
    loaded = load_backends(select_all(caps))
    assert set(loaded) == set(backends.OP_FAMILIES)
    assert {op: b.name for op, b in loaded.items()} == dict.fromkeys(loaded, "torch")
    # the torch attention and conv1d references loop over host lists: no capture
    assert graph_blocker(loaded) == "attention backend torch cannot be captured in a CUDA graph"
    del loaded["attention"]
    assert graph_blocker(loaded) == "conv1d backend torch cannot be captured in a CUDA graph"
    del loaded["conv1d"]
    # the moe reference reads the per-expert token counts on the host
    assert graph_blocker(loaded) == "moe backend torch cannot be captured in a CUDA graph"
    del loaded["moe"]
    # the mla reference loops over sequences with the host lists
    assert graph_blocker(loaded) == "mla backend torch cannot be captured in a CUDA graph"
    del loaded["mla"]
    assert graph_blocker(loaded) is None  # gdn_decode, fused and decode_gemm references can


def test_every_fused_and_decode_gemm_backend_declares_graph_support() -> None:
    from deltaserve.ops.fused import FusedOps

    assert FusedOps.supports_cuda_graph is False  # a new implementation must opt in
    pytest.importorskip("triton")
    for op in ("fused", "decode_gemm"):
        for spec in backends.OP_FAMILIES[op].backends:
            module, name = spec.target.split(":")
            cls = getattr(__import__(module, fromlist=[name]), name)
            assert cls.supports_cuda_graph is True, spec
