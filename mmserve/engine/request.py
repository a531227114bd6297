"""A request inside the engine: its tokens, its KV slots, its multimodal items, its progress.

Lengths are derived: `token_ids` = prompt + outputs; `num_computed` tokens have KV in `slots`;
`remaining` = tokens still to compute before the next sample. A request is prefilling while
`remaining > 1` (a chunk may stop anywhere, inside an image included, except inside a bidirectional block) and
decoding when exactly the last sampled token is left to compute.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from mmserve.engine.cache_salt import prefix_key
from mmserve.multimodal.embedding import PlacedEmbedding
from mmserve.multimodal.items import MultimodalItem
from mmserve.sampling_params import SamplingParams

TEXT_PREFILL_SUFFIX = "~text"


def text_prefill_id(request_id: str) -> str:
    """The engine's id of the internal request prefilling `request_id`'s text before its media (overlap)."""
    return request_id + TEXT_PREFILL_SUFFIX


def choice_id(group_id: str, index: int) -> str:
    """The engine's id of choice `index` of an n > 1 request."""
    return f"{group_id}#{index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HANDOFF = "handoff"  # prefill server: prefilled, its KV on the way to a decode engine (slots still held)
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]  # expanded: item tokens carry their pad values
    params: SamplingParams
    items: list[MultimodalItem] = field(default_factory=list)
    embeddings: list[PlacedEmbedding] = field(default_factory=list)
    positions: torch.Tensor | None = None  # (rows, prompt_len): 3 rows for M-RoPE, 1 for plain RoPE
    rope_delta: int = 0  # decode position of index i >= prompt_len: i + rope_delta
    generator: torch.Generator | None = None
    cache_salt: str | None = None  # tenant scope of the prefix cache: see mmserve.engine.cache_salt
    handoff: object | None = None  # prefill server: the KvTarget its KV goes to after the first token
    # False on a decode server: the prompt's KV came from a prefill engine and its embeddings are not here, so
    # the request cannot be recomputed after a retraction (it fails instead; admission makes that rare).
    recomputable: bool = True
    group_id: str = ""  # n > 1: the API request this choice belongs to ("" = request_id)
    index: int = 0  # the choice's index in its group
    matcher: object | None = None  # structured outputs: mmserve.engine.grammar.GrammarMatcher
    # internal (encode-prefill overlap): compute the prompt into the prefix cache, sample nothing
    prefill_only: bool = False
    own_prefill_tokens: int = 0  # prompt tokens its own text prefill computed: not counted as cached

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it (vLLM's stop_reason); None for EOS
    stopped_on_token: bool = False  # its last token is EOS or a stop token id (not part of the text)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    prefix_handle: object | None = None  # locked radix node while running
    decode_run: list[int] = field(default_factory=list)  # slots taken for its next decode tokens (Scheduler)
    # Models with sliding-window layers (mmserve.engine.slots): its window-pool slot per position (-1: none held),
    # its unused decode run of them, rows kept for the prefix cache until its prompt is cached, and how far rows
    # behind its window were freed
    window_buffer: torch.Tensor | None = None
    window_run: list[int] = field(default_factory=list)
    window_keep: torch.Tensor | None = None
    window_released: int = 0
    prefix_cache_pending: bool = True  # its prompt is not in the prefix cache yet (Scheduler.cache_prompt)
    # Families with bidirectional item blocks: [start, end) of every block (runs of items' tokens that attend to
    # each other both ways), in order; a prefill chunk never ends strictly inside one
    blocks: list[tuple[int, int]] = field(default_factory=list)
    # Hybrid models: its linear-attention state (a StatePool slot) and the position it stands at (0: empty, the
    # sequence not started; None: unknown after a failed step, so never donated to the prefix cache)
    state_slot: int | None = None
    state_pos: int | None = None
    num_retractions: int = 0
    passed_over: int = 0  # steps it wanted prefill budget and got none, until its prefill completes (aging)
    uncached_estimate: int | None = None  # waiting: tokens left after its prefix cache hit, estimated once
    encode_timings: object | None = None  # EncodeTimings of the in-process encoder, if it encoded
    accepted: object | None = None  # the AcceptedMsg the intake sent (a handoff passes it on)
    hf_prompt_ids: list[int] | None = None  # the expanded prompt with the model's placeholder ids (no pads)

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        assert self.params.max_tokens is not None, "the engine resolves max_tokens at admission"
        self.group_id = self.group_id or self.request_id
        self.token_ids = list(self.prompt_ids)
        self.prompt_logprobs: list = []  # prompt_logprobs: one entry per prompt token (None for the first)
        self._prompt_set: torch.Tensor | None = None
        self._block_ids: torch.Tensor | None = None
        # Slot of every computed token; sized for the whole request so appends never reallocate.
        self.slot_buffer = torch.empty(len(self.prompt_ids) + self.params.max_tokens, dtype=torch.int64)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_len(self) -> int:
        return self.slot_buffer.shape[0]

    @property
    def slots(self) -> torch.Tensor:
        return self.slot_buffer[: self.num_computed]

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.remaining > 1 or not self.output_ids

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def block_ids(self) -> torch.Tensor | None:
        """Per prompt token, the index of its bidirectional block (-1 outside any); None without blocks. Computed
        once."""
        if not self.blocks:
            return None
        if self._block_ids is None:
            ids = torch.full((self.prompt_len,), -1, dtype=torch.int32)
            for k, (start, end) in enumerate(self.blocks):
                ids[start:end] = k
            self._block_ids = ids
        return self._block_ids

    def resume_points(self, start: int, end: int) -> list[int]:
        """Positions p in (start, end], before the prompt's end, where later requests are likely to resume: every
        item's start and end (same system prompt + another image; same image + another question; overlap stages
        end at item starts) and the prompt's last token but one (a repeat and n > 1 siblings look up all but the
        last token). Hybrid models checkpoint their state there, windowed ones keep the window rows before them;
        the end of what a request computed is saved when it leaves (`Scheduler._release`)."""
        wanted = {self.prompt_len - 1}
        for item in self.items:
            wanted.update((item.offset, item.end))
        return sorted(p for p in wanted if start < p <= end and p < self.prompt_len)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk from `start` that would stop at `end` does stop: never strictly inside a
        bidirectional block (its tokens must see each other in one forward), so before a block it reaches, or past
        the end of the block it starts in (even past the budget)."""
        block = self._block_around(end)
        if block is None:
            return end
        return block[0] if start < block[0] else block[1]

    def safe_prefix(self, n: int) -> int:
        """The longest prefix of the first n tokens that ends outside every bidirectional block: what may enter
        the prefix cache (KV of part of a block was computed without the rest of it)."""
        block = self._block_around(n)
        return n if block is None else block[0]

    def _block_around(self, n: int) -> tuple[int, int] | None:
        """The bidirectional block that position n cuts strictly inside (start < n < end), if any."""
        for a, b in self.blocks:
            if a < n < b:
                return a, b
            if a >= n:
                break
        return None

    @property
    def prompt_token_set(self) -> torch.Tensor:
        """The prompt's distinct token ids (repetition penalty), computed once."""
        if self._prompt_set is None:
            self._prompt_set = torch.unique(torch.tensor(self.prompt_ids, dtype=torch.int64))
        return self._prompt_set

    def cache_key(self, n: int) -> list[int]:
        """The first `n` token ids as the prefix cache keys them (salted in the first position)."""
        return prefix_key(self.token_ids[:n], self.cache_salt)

    def append_output(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
