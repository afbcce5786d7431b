"""Per-request sampling parameters, validated once at the door so the engine can trust them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Below this temperature sampling is greedy (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """An invalid sampling value; the server turns it into a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per sampled token; 0 = only the sampled one
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def max_stop_string_length(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError with a message a client can act on, naming the field."""
        checks: list[tuple[bool, str, str]] = [
            (1 <= self.n <= 128, f"n must be between 1 and 128, got {self.n}", "n"),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}", "temperature"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p"),
            (self.top_k >= 0, f"top_k must be -1 (disable) or at least 1, got {self.top_k}", "top_k"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty"),
            (0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}",
             "max_tokens"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({self.max_tokens})",
             "min_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs"),
        ]
        for ok, message, param in checks:
            if not ok:
                raise SamplingParamsError(message, param)
        if vocab_size is not None:
            for token_id in self.stop_token_ids:
                if not 0 <= token_id < vocab_size:
                    raise SamplingParamsError(
                        f"stop_token_ids contains {token_id}, outside the vocabulary [0, {vocab_size})",
                        "stop_token_ids")

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n parallel samples: one sequence each, distinct but reproducible seeds."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))
