"""Configuration of the engine (:class:`InferenceConfig`) and of each request (:class:`SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_inference.errors import InferenceConfigError, InvalidRequestError

__all__ = ["InferenceConfig", "SamplingParams"]


def _check_positive(name: str, value: int, error: type[Exception]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{name}={value!r}; expected a positive integer")


@dataclass(kw_only=True, slots=True)
class InferenceConfig:
    """Sizes, memory and execution knobs of an :class:`mcore_inference.InferenceEngine`.

    Raises:
        InferenceConfigError: If a field holds an invalid value.
    """

    max_batch_size: int = 64
    """Most requests decoding (or prefilling) at the same time."""
    max_sequence_length: int = 2048
    """Most tokens of one request, prompt plus generated tokens."""
    block_size: int = 16
    """Tokens per KV-cache block (a power of two)."""
    num_blocks: int | None = None
    """KV-cache blocks to allocate (one more is reserved as the padding scratch block)."""
    kv_memory_bytes: int | None = None
    """KV-cache memory budget in bytes, used when ``num_blocks`` is None."""
    max_tokens_per_step: int | None = None
    """Token budget of one step: decode tokens first, then prefill chunks (>= max_batch_size);
    None means max(2048, max_batch_size)."""
    prefill_chunk_size: int = 512
    """Most prompt tokens of one request computed in one step (chunked prefill)."""
    attention_split_size: int = 512
    """Context positions per split of the split-KV attention kernel (a multiple of block_size)."""
    use_cuda_graphs: bool = True
    """Replay CUDA graphs for pure-decode steps on a CUDA model (ignored on the CPU)."""
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """Padded decode batch sizes to capture; None captures 1, 2, 4, 8 then multiples of 16."""
    cuda_graph_prefill_token_counts: tuple[int, ...] | None = None
    """Hybrid (Mamba) models: token-count buckets of the non-decode (prefill and mixed) steps
    to capture as CUDA graphs; None captures 16, 32, 64 ... up to the step's token budget, an
    empty tuple captures none (non-decode steps run eagerly)."""
    cuda_graph_mixed_steps: bool = True
    """Dense models on one stage without expert-parallel lockstep: run a step that prefills
    (prompt chunks, alone or next to decoding requests) of at most the largest decode bucket's
    token count in the decode CUDA graph of the smallest bucket that holds its tokens, instead
    of eagerly. The paged attention treats every token alike (each attends to the cache up to
    its position), so the graph computes such a step as it computes decodes; a server whose
    requests arrive one by one then runs its ramp-up in graphs, not in eager mixed steps. A step
    then takes at most the largest bucket's tokens while the prompt tokens waiting to be
    prefilled fit in a few such steps (``mcore_inference.scheduler.GRAPH_BACKLOG_STEPS``); a
    larger backlog is prefilled in eager steps of the whole ``max_tokens_per_step``."""
    fuse_tp_communication: bool = True
    """Under tensor parallelism, reduce each layer's output with the fused reduce-scatter + add
    + RMSNorm + all-gather of mcore-kernels (symmetric memory when available, NCCL collectives
    otherwise) instead of all-reduce, when the model supports it; see ``engine.describe()``."""
    kv_dtype: torch.dtype | None = None
    """Dtype of the KV cache; None uses the dtype of the model's parameters."""
    async_token_readback: bool = True
    """Read sampled tokens back to the host one step late (asynchronous copy into pinned memory),
    feeding continuing requests their token on the device, so the host prepares the next step
    while the GPU runs (see ``mcore_inference.readback``); results are unchanged. Used with one
    rank per replica and one pipeline stage, without expert-parallel lockstep."""
    multi_step_decode: int = 8
    """Most decode steps run back to back per host round trip (see
    ``mcore_inference.multi_step``): when every request of a decode step only continues and
    none can reach its length limit sooner, the device feeds each step the previous step's
    samples and the host reads the tokens of all the steps at once, so its per-step
    bookkeeping is paid once per run. Tokens, log-probs and finish reasons are those of single
    steps; a request that stops on a stop token or word leaves the batch when its run has been
    read, and a request that arrives during a run waits for its end. 1 turns it off. Used where
    ``async_token_readback`` is (one rank per replica, one stage, no expert-parallel
    lockstep), not for hybrid (Mamba) models."""
    fused_decode: bool = True
    """Run a whole, unsharded dense ``GPTModel`` through the engine's fused forward (one GEMM
    for q/k/v and one for gate/up over weight copies the engine keeps in sync, RoPE fused with
    the cache write, fused SwiGLU; see ``mcore_inference.fused_decode``); False, or another
    model, runs the model's own forward. Costs a second copy of those weights."""
    decode_pdl: bool = True
    """Launch the fused forward's Triton kernels (the ``decode_gemv`` projections of steps of
    at most two tokens, RoPE + cache write, attention) with programmatic dependent launch on
    Hopper or newer GPUs (``mcore_kernels.pdl``): each starts, and the projections stream their
    weights, while the previous kernel finishes (one H100, Qwen2.5-0.5B shape, batch 1: 1230
    against 1109 tok/s; one H200, batch 64: 62.1k against 60.7k; not above
    ``fused_decode.GEMM_PDL_MAX_ROWS`` tokens, where it was slower). Results are unchanged;
    ignored on other devices and without ``fused_decode``."""
    mla_latent_kv_cache: bool = True
    """For Multi-head Latent Attention models: cache each token's latent and shared rotary
    key (``kv_lora_rank + qk_rope_head_dim`` channels per layer) and decode with absorbed
    weights; False caches the up-projected per-head keys and values like a multi-head model
    (for comparison). Ignored for other models."""
    tokenizer_path: str | None = None
    """Path of a ``tokenizer.json`` (or a directory holding one) for string stop words and text."""
    seed: int = 0
    """Seed from which requests without their own seed draw one (in arrival order)."""
    share_prompt_prefixes: bool = False
    """Requests whose prompts begin with the same full KV blocks of tokens share those blocks
    (the blocks before the one holding the prompt's last token): the first admitted computes
    them, the others wait until it has and prefill only the rest of their prompt, so a group of
    ``n`` samples of one prompt (GRPO) prefills it about once and keeps one copy in the cache.
    Each request still computes its prompt's last block, so its first sampled token comes from
    its own forward. Ignored for hybrid (Mamba) models, whose state is not in the blocks."""
    batch_invariant: bool = False
    """Run every step in ``mcore_kernels.batch_invariant`` mode (also on when the model's
    ``config.batch_invariant`` is): a request's tokens and log-probs do not depend on the batch,
    the prefill chunking or CUDA graph padding, and equal the training forward's bitwise."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_step is None and isinstance(self.max_batch_size, int):
            self.max_tokens_per_step = max(2048, self.max_batch_size)
        for name in (
            "max_batch_size",
            "max_sequence_length",
            "block_size",
            "max_tokens_per_step",
            "prefill_chunk_size",
            "attention_split_size",
            "multi_step_decode",
        ):
            _check_positive(name, getattr(self, name), InferenceConfigError)
        if self.block_size & (self.block_size - 1):
            raise InferenceConfigError(f"block_size={self.block_size}; expected a power of two")
        if self.attention_split_size % self.block_size:
            raise InferenceConfigError(
                f"attention_split_size={self.attention_split_size}; expected a multiple of "
                f"block_size={self.block_size}"
            )
        assert self.max_tokens_per_step is not None
        if self.max_tokens_per_step < self.max_batch_size:
            raise InferenceConfigError(
                f"max_tokens_per_step={self.max_tokens_per_step}; expected at least "
                f"max_batch_size={self.max_batch_size} so every decoding request fits a step"
            )
        if self.num_blocks is not None:
            _check_positive("num_blocks", self.num_blocks, InferenceConfigError)
        if self.kv_memory_bytes is not None:
            _check_positive("kv_memory_bytes", self.kv_memory_bytes, InferenceConfigError)
        if self.cuda_graph_batch_sizes is not None:
            sizes = tuple(self.cuda_graph_batch_sizes)
            for size in sizes:
                _check_positive("cuda_graph_batch_sizes entry", size, InferenceConfigError)
            if not sizes or max(sizes) > self.max_batch_size:
                raise InferenceConfigError(
                    f"cuda_graph_batch_sizes={sizes}; expected a non-empty tuple with entries at "
                    f"most max_batch_size={self.max_batch_size}"
                )
            self.cuda_graph_batch_sizes = tuple(sorted(set(sizes)))
        if self.cuda_graph_prefill_token_counts is not None:
            counts = tuple(self.cuda_graph_prefill_token_counts)
            for count in counts:
                _check_positive(
                    "cuda_graph_prefill_token_counts entry", count, InferenceConfigError
                )
            self.cuda_graph_prefill_token_counts = tuple(sorted(set(counts)))
        if self.kv_dtype is not None and (
            not isinstance(self.kv_dtype, torch.dtype) or not self.kv_dtype.is_floating_point
        ):
            raise InferenceConfigError(
                f"kv_dtype={self.kv_dtype!r}; expected None or a floating-point torch.dtype "
                "(e.g. torch.bfloat16)"
            )
        if not isinstance(self.fuse_tp_communication, bool):
            raise InferenceConfigError(
                f"fuse_tp_communication={self.fuse_tp_communication!r}; expected True or False"
            )
        if not isinstance(self.cuda_graph_mixed_steps, bool):
            raise InferenceConfigError(
                f"cuda_graph_mixed_steps={self.cuda_graph_mixed_steps!r}; expected True or False"
            )
        if not isinstance(self.share_prompt_prefixes, bool):
            raise InferenceConfigError(
                f"share_prompt_prefixes={self.share_prompt_prefixes!r}; expected True or False"
            )
        if not isinstance(self.batch_invariant, bool):
            raise InferenceConfigError(
                f"batch_invariant={self.batch_invariant!r}; expected True or False"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InferenceConfigError(f"seed={self.seed!r}; expected a non-negative integer")

    @property
    def max_blocks_per_sequence(self) -> int:
        """Width of a block table: blocks needed by the longest sequence."""
        return -(-self.max_sequence_length // self.block_size)

    def graph_prefill_token_counts(self) -> tuple[int, ...]:
        """Token-count buckets of the non-decode CUDA graphs (hybrid models).

        Returns:
            Sorted token counts: the configured ones, or powers of two from 16 up to the step's
            token budget (``max_tokens_per_step``, else ``max_batch_size``) and the budget.
        """
        if self.cuda_graph_prefill_token_counts is not None:
            return self.cuda_graph_prefill_token_counts
        budget = self.max_tokens_per_step or self.max_batch_size
        counts = {budget}
        count = 16
        while count < budget:
            counts.add(count)
            count *= 2
        return tuple(sorted(counts))

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The padded decode batch sizes to capture.

        Returns:
            Sorted batch sizes, the configured ones or 1, 2, 4, 8 then multiples of 16 up to
            ``max_batch_size`` (which is always included).
        """
        if self.cuda_graph_batch_sizes is not None:
            return self.cuda_graph_batch_sizes
        sizes = {size for size in (1, 2, 4, 8) if size <= self.max_batch_size}
        sizes.update(range(16, self.max_batch_size + 1, 16))
        sizes.add(self.max_batch_size)
        return tuple(sorted(sizes))


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Log-probability convention: ``GenerationResult.logprobs[i]`` is
    ``log_softmax(logits / temperature)[token_i]`` over the full vocabulary, before top-k/top-p
    truncation, i.e. ``mcore_kernels.token_logprobs(logits, tokens, temperature=temperature)``
    on a training forward; greedy requests (temperature 0) report temperature 1.

    Raises:
        InvalidRequestError: If a field holds an invalid value.
    """

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches top_p; 1 disables."""
    seed: int | None = None
    """Seed of this request's sampling; None draws one from the engine's seed."""
    max_tokens: int = 16
    """Most tokens to generate (0 returns at once with finish reason length)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request (the stop token is kept in the output)."""
    stop_words: tuple[tuple[int, ...] | str, ...] = ()
    """Token sequences (all tokens consecutively) or strings (with a tokenizer) that end it."""
    return_logprobs: bool = False
    """Return the log-probability of every generated token."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (the engine calls it again when a request arrives).

        Raises:
            InvalidRequestError: If a field holds an invalid value; the message names it.
        """
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < 1e6:
            raise InvalidRequestError(
                f"temperature={self.temperature!r}; expected a number >= 0 (0 is greedy)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k={self.top_k!r}; expected an integer >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p={self.top_p!r}; expected a number in (0, 1]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise InvalidRequestError(f"seed={self.seed!r}; expected None or an integer >= 0")
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 0
        ):
            raise InvalidRequestError(f"max_tokens={self.max_tokens!r}; expected an integer >= 0")
        for name in ("stop_token_ids", "stop_words"):
            value = getattr(self, name)
            # A bare string or int here is a common slip (stop_words="</s>" would stop at
            # each of its characters): ask for the sequence instead of guessing.
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                raise InvalidRequestError(
                    f"{name}={value!r}; expected a tuple or list of entries, e.g. ({value!r},)"
                )
        self.stop_token_ids = tuple(self.stop_token_ids)
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequestError(
                    f"stop_token_ids entry {token!r}; expected a non-negative integer"
                )
        words: list[tuple[int, ...] | str] = []
        for word in self.stop_words:
            if isinstance(word, str):
                if not word:
                    raise InvalidRequestError("stop_words entry ''; expected a non-empty string")
                words.append(word)
                continue
            sequence = tuple(word) if isinstance(word, (tuple, list)) else ()
            if not sequence or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in sequence
            ):
                raise InvalidRequestError(
                    f"stop_words entry {word!r}; expected a string or a non-empty sequence of "
                    "non-negative token ids"
                )
            words.append(sequence)
        self.stop_words = tuple(words)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature == 0.0
