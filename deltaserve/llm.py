"""Offline API with vLLM's names and shapes: LLM(...).generate / .chat."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from deltaserve.config import create_engine_config
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.loader.tokenizer import apply_chat_template
from deltaserve.multimodal.chat_parts import load_images, parse_chat_messages
from deltaserve.multimodal.media import MediaConfig, MediaLoader
from deltaserve.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams

PromptType = str | dict

# LLM keyword -> MediaConfig field (the `deltaserve serve` flags of the same names)
_MEDIA_KEYWORDS = {
    "allowed_local_media_path": "allowed_local_media_path",
    "media_fetch_timeout": "fetch_timeout",
    "max_image_bytes": "max_image_bytes",
    "max_image_pixels": "max_image_pixels",
    "allowed_media_domains": "allowed_media_domains",
}


class LLM:
    """An engine for offline batched generation.

    `LLM(model, dtype=, device=, max_model_len=, max_num_seqs=, max_num_batched_tokens=,
    enable_chunked_prefill=, enable_prefix_caching=, block_size=, skip_tokenizer_init=, seed=)`
    with `model` a local Hugging Face checkpoint directory; or `LLM(random_model=NAME, ...)` for
    a preset's real shapes with random weights (benchmarks; no tokenizer). GPU options:
    `gpu_memory_utilization=`, `enforce_eager=`, `state_dtype=`. Kernel backends, generated from
    the registry (deltaserve.backends.OP_FAMILIES): one keyword per op family, `<family>_backend=`
    (`attention_backend="triton"`, `gdn_decode_backend=`, `conv1d_backend=`, `fused_backend=`,
    ...), or all at once as `backends={"attention": "triton", ...}`; "auto" or absent: the
    fastest able backend. An unknown family or backend name fails at once, naming the valid ones.
    `tensor_parallel_size=N` runs one process per device (N GPUs, or N CPU processes over gloo).
    vLLM's `tokenizer=`, `chat_template=` (a file or the template text) and
    `trust_remote_code=` (accepted; no checkpoint code is run) work too. The keywords are those
    of `deltaserve.config.create_engine_config`; each has a `deltaserve` command-line flag.
    Images in `chat` (deltaserve.multimodal.media.MediaConfig, as `deltaserve serve`'s flags):
    `allowed_local_media_path=DIR` lets file:// image URLs under DIR load (vLLM's keyword;
    default: refused), `allowed_media_domains=[hosts]` (vLLM's; default: any host),
    `media_fetch_timeout=` seconds per http(s) fetch, `max_image_bytes=`, `max_image_pixels=`.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        model = None if model is None else str(model)
        media = {key: kwargs.pop(key) for key in _MEDIA_KEYWORDS if key in kwargs}
        if media.get("allowed_media_domains") is not None:
            media["allowed_media_domains"] = tuple(media["allowed_media_domains"])
        self.media = MediaLoader(
            MediaConfig(**{_MEDIA_KEYWORDS[key]: value for key, value in media.items()})
        )
        self.llm_engine = LLMEngine(create_engine_config(model, **kwargs))
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (also done when the LLM is garbage
        collected or the program exits)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, {"prompt": str} or {"prompt_token_ids": [...]},
        a dict optionally with {"multi_modal_data": {"image": PIL image or list}}); outputs come
        back in the prompts' order. Every prompt is validated before any is queued. As in vLLM,
        a "Processed prompts" bar counts finished requests on stderr unless use_tqdm=False."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        # Tokenize and validate every prompt first: a bad prompt queues nothing.
        validated = []
        for p in prompts:
            validated.append(engine.process_prompt(p))  # images preprocessed once, here
        ids = []
        try:
            for p, sp in zip(validated, params):
                rid = str(next(self._counter))
                engine.add_request(rid, p, sp)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            raise

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation and generate.

        Messages are OpenAI's: content a string or a list of parts, `{"type": "text", ...}`,
        `{"type": "image_url", "image_url": {"url": ...}}` (a data:image/...;base64, URI, an
        http(s) URL, or a file:// URL under `allowed_local_media_path`) and vLLM's
        `{"type": "image_pil", "image_pil": PIL.Image.Image}`. Each image part renders as the
        template's placeholder and its image goes to the engine as `multi_modal_data`, in
        order. An image that cannot be used raises MediaError (a ValueError) naming the part."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            inputs = parse_chat_messages(conv, allow_pil=True, join_text_parts=False)
            text, ids = apply_chat_template(
                self.llm_engine.tokenizer,
                inputs.conversation,
                add_generation_prompt,
                chat_template_kwargs,
            )
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if inputs.images:
                prompt["multi_modal_data"] = {"image": load_images(inputs.images, self.media)}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        while pending:
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    finished[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
            if pending and not engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)} vanished from the engine")
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]
