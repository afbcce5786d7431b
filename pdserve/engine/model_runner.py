"""The model runner: owns the tensors (weights, KV cache, generators), turns a plan into a batch, runs the
model and samples. It makes no policy: what to run comes from the scheduler's plan."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdserve.engine.faults import EngineFaults
from pdserve.engine.outputs import KVConnectorOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.engine.request import MultiModalItem
from pdserve.engine.sampler import sample
from pdserve.ids import ReqId
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.layers.attention import AttentionMetadata, PrefillChunk
from pdserve.models.config import ModelSpec
from pdserve.models.llama import ForwardContext, NoHooks
from pdserve.models.registry import LoadedModel, build_model
from pdserve.native.backend import choose_decode_kernel, pointwise_ops_for, prefill_kernel_for
from pdserve.utils import cdiv

log = logging.getLogger(__name__)

# Allocates the KV cache tensor; data planes that share memory across processes provide their own.
KVAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def default_kv_allocator(shape: tuple[int, ...], dtype: torch.dtype,
                         device: torch.device = torch.device("cpu")) -> torch.Tensor:
    # Zeroed, not empty: padded attention multiplies masked slots by 0, and 0 * NaN from stale memory is NaN.
    return torch.zeros(shape, dtype=dtype, device=device)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether memory on `a` serves a model on `b`; a device named without an index (`cuda`) matches any of its
    type's, as a tensor made on `cuda` reports `cuda:0`."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts end to end; a decode-only step (the steady state) has one, taken as is rather than copied."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class ModelRunner:
    def __init__(self, spec: ModelSpec, block_size: int, seed: int = 0, device: str = "cpu",
                 connector: KVConnectorWorker | None = None, attention_backend: str | None = None) -> None:
        self.device = torch.device(device)
        self.dtype = spec.dtype
        self.block_size = block_size
        self.loaded: LoadedModel = build_model(spec, self.device)
        self.model = self.loaded.model
        self.cfg = self.loaded.text_config
        self.connector = connector
        self.vision = self.loaded.vision  # a LLaVA-style encoder, or None for text models
        self.encoder_cache: dict[str, torch.Tensor] = {}  # mm_hash -> [num_embeds, hidden], per the scheduler
        self.ec_loader: Callable[[MultiModalItem], torch.Tensor] | None = None  # set by an EC connector
        self.kv_cache: torch.Tensor | None = None
        self.generators: dict[ReqId, torch.Generator] = {}
        self.default_generator = torch.Generator().manual_seed(seed)
        self.faults = EngineFaults()
        self.decode_kernel = choose_decode_kernel(attention_backend, self.device, self.dtype)
        self.pointwise_ops = pointwise_ops_for(self.decode_kernel)
        self.prefill_kernel = prefill_kernel_for(self.decode_kernel, self.dtype)

    # -- KV cache ---------------------------------------------------------------------------------------
    def kv_block_shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.num_layers, 2, c.num_kv_heads, self.block_size, c.head_dim)

    def kv_block_bytes(self) -> int:
        n = 1
        for d in self.kv_block_shape():
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int, allocator: KVAllocator | None = None) -> torch.Tensor:
        """The KV cache on the runner's device, zeroed; `allocator` (a data plane's) places it in memory the plane
        can share, which must then be on that same device."""
        shape = (num_blocks, *self.kv_block_shape())
        if allocator is None:
            kv_cache = default_kv_allocator(shape, self.dtype, self.device)
        else:
            kv_cache = allocator(shape, self.dtype)
        if not same_device(kv_cache.device, self.device):
            raise ValueError(f"the KV cache was allocated on {kv_cache.device} but the model runs on {self.device}: "
                             "the configured data plane cannot hold this device's KV cache")
        self.kv_cache = kv_cache
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_cache)
        return self.kv_cache

    # -- one step ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for rid in plan.finished_req_ids:
            self.generators.pop(rid, None)
        for mm_hash in plan.free_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        connector = self.connector
        if connector is not None and plan.kv_connector_metadata is not None:
            connector.bind_connector_metadata(plan.kv_connector_metadata)
            connector.start_load_kv()
        out = ModelRunnerOutput()
        try:
            self._compute(plan.scheduled, out)
        except Exception as exc:  # noqa: BLE001 - fails this step's requests; the tensors stay usable
            # Nothing of the step is kept: its requests end with the error (their blocks are freed, none indexed
            # for prefix caching), and the next step starts from the scheduler's state, which this never touched.
            log.exception("model step over %d requests failed; failing them", len(plan.scheduled))
            out.sampled_token_ids.clear()
            out.logprobs.clear()
            out.failed_req_ids = {s.request_id for s in plan.scheduled}
            out.error = f"the engine failed to compute this request ({type(exc).__name__}: {exc})"
        if connector is not None:
            if not out.failed_req_ids:  # a failed step saved nothing worth announcing
                connector.wait_for_save()
            sending, recving = connector.get_finished(plan.finished_req_ids)
            out.connector = KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, failed_recving=connector.get_failed_recving(),
                invalid_block_ids=connector.get_block_ids_with_load_errors(),
                refused_recving=connector.get_refused_recving(), transfers=connector.get_transfer_records())
            connector.clear_connector_metadata()
        return out

    def _compute(self, scheduled: list[ScheduledRequest], out: ModelRunnerOutput) -> None:
        if any(s.mm_to_produce for s in scheduled):
            out.invalid_mm_hashes = self._produce_encoder_outputs(scheduled)
            if out.invalid_mm_hashes:  # those requests wait for the scheduler's rollback; the others run
                scheduled = [s for s in scheduled
                             if not any(m.mm_hash in out.invalid_mm_hashes for m in s.mm_items)]
        if scheduled:
            self.faults.check_compute(scheduled)
            self._run(scheduled, out)

    def _run(self, scheduled: list[ScheduledRequest], out: ModelRunnerOutput) -> None:
        batch = [s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode]
        input_ids, positions, attn, sample_rows = self._prepare(batch)
        ctx = ForwardContext(attn=attn, kv_cache=self.kv_cache, hooks=self.connector or NoHooks(),
                             ops=self.pointwise_ops)
        # One row per sampling request: where some rows do not sample, the last layer keeps only those that do.
        hidden = self.model.forward(input_ids, positions, ctx, inputs_embeds=self._embed_inputs(batch, input_ids))
        sampling = [batch[i] for i, _ in sample_rows]
        if not sampling:
            return
        logits = self.model.compute_logits(hidden)
        result = sample(logits, sampling, [self._generator(s) for s in sampling], self.default_generator)
        for i, s in enumerate(sampling):
            out.sampled_token_ids[s.request_id] = result.token_ids[i]
            if i in result.logprobs:
                out.logprobs[s.request_id] = result.logprobs[i]

    # -- encoder outputs ----------------------------------------------------------------------------------
    def _produce_encoder_outputs(self, scheduled: list[ScheduledRequest]) -> dict[str, str]:
        """Load remote items and encode local ones into the encoder cache; returns failed loads (mm_hash: why)."""
        failed: dict[str, str] = {}
        to_encode: dict[str, MultiModalItem] = {}
        for s in scheduled:
            for item in s.mm_items:
                if item.mm_hash not in s.mm_to_produce or item.mm_hash in self.encoder_cache:
                    continue
                if item.remote and self.ec_loader is not None:
                    try:
                        self.encoder_cache[item.mm_hash] = self._checked(item, self.ec_loader(item))
                    except Exception as exc:  # noqa: BLE001 - any load failure is the policy's to handle
                        failed[item.mm_hash] = f"{type(exc).__name__}: {exc}"
                else:
                    to_encode[item.mm_hash] = item
        if to_encode:
            self.encode_items(list(to_encode.values()))
        return failed

    def encode_items(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Run the vision encoder on items (batched) and keep the outputs in the encoder cache."""
        if self.vision is None:
            raise ValueError("this model has no vision encoder")
        outputs = self.vision.encode(torch.stack([item.data for item in items]).to(self.device))
        for item, output in zip(items, outputs, strict=True):
            self.encoder_cache[item.mm_hash] = output
        return list(outputs)

    def _checked(self, item: MultiModalItem, output: torch.Tensor) -> torch.Tensor:
        expected = (item.length, self.cfg.hidden_size)
        if tuple(output.shape) != expected:
            raise ValueError(f"encoder output for {item.mm_hash} has shape {tuple(output.shape)}, expected {expected}")
        return output.to(device=self.device, dtype=self.dtype)

    def _embed_inputs(self, batch: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings, with each media item's encoder output in place of its placeholder tokens."""
        if not any(s.mm_items for s in batch):
            return None
        embeds = self.model.embed(input_ids)
        row = 0
        for s in batch:
            start, end = s.start_position, s.start_position + len(s.token_ids)
            for item in s.mm_items:
                lo, hi = max(start, item.offset), min(end, item.offset + item.length)
                output = self.encoder_cache[item.mm_hash]
                embeds[row + lo - start:row + hi - start] = output[lo - item.offset:hi - item.offset]
            row += end - start
        return embeds

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.sampling_params.seed
        if seed is None:
            return None
        generator = self.generators.get(s.request_id)
        if generator is None:
            generator = self.generators[s.request_id] = torch.Generator().manual_seed(seed)
        return generator

    def generator_state(self, request_id: ReqId) -> bytes | None:
        """Where a seeded request's random stream stands (None before its first random sample)."""
        generator = self.generators.get(request_id)
        return None if generator is None else generator.get_state().numpy().tobytes()

    def restore_generator(self, request_id: ReqId, seed: int, state: bytes | None, draws: int) -> None:
        """Continue a seeded request's random stream where it stood on another instance: from its exact state,
        or by replaying `draws` samples from the seed (a random sample draws one exponential per vocabulary
        entry, as the sampler's race does)."""
        generator = torch.Generator().manual_seed(seed)
        if state is not None:
            generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        elif draws:
            scratch = torch.empty(self.cfg.vocab_size, dtype=torch.float32)
            for _ in range(draws):
                scratch.exponential_(generator=generator)
        self.generators[request_id] = generator

    def _prepare(self, batch: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[int, int]]]:
        """Flat inputs, attention metadata, and (batch index, last row) of every request that samples.

        Decodes (first in the batch) get their position and slot in Python, one each; a prefill chunk's positions
        and slots are computed as tensors (arange, one gather from its block table): an 8192-token chunk took 5 ms
        token by token in Python."""
        bs = self.block_size
        decodes = [s for s in batch if s.is_decode]
        token_ids: list[int] = []
        positions = [torch.tensor([s.start_position for s in decodes], dtype=torch.long)]
        slot_block = [torch.tensor([s.block_ids[s.start_position // bs] for s in decodes], dtype=torch.long)]
        prefills: list[PrefillChunk] = []
        sample_rows: list[tuple[int, int]] = []
        row = 0
        for index, s in enumerate(batch):
            n = len(s.token_ids)
            token_ids.extend(s.token_ids)
            if not s.is_decode:
                table = torch.tensor(s.block_ids[:cdiv(s.start_position + n, bs)], dtype=torch.long)
                chunk_positions = torch.arange(s.start_position, s.start_position + n)
                positions.append(chunk_positions)
                slot_block.append(table[chunk_positions // bs])
                prefills.append(PrefillChunk(row, row + n, s.start_position, table))
            row += n
            if s.sample:
                sample_rows.append((index, row - 1))
        flat_positions = _joined(positions)
        attn = AttentionMetadata(slot_block=_joined(slot_block), slot_offset=flat_positions % bs,
                                 num_decode_tokens=len(decodes), prefills=prefills)
        if decodes:
            self._decode_tables(attn, [s.block_ids for s in decodes], [s.start_position + 1 for s in decodes])
        if prefills and self.prefill_kernel is not None:
            self._prefill_tables(prefills, attn)
        if len(sample_rows) < row:
            self._sampled_rows(batch, sample_rows, attn)
        input_ids = torch.tensor(token_ids)
        if self.device.type != "cpu":  # built on the host, where Python lists become tensors; moved once per step
            return input_ids.to(self.device), flat_positions.to(self.device), attn.to(self.device), sample_rows
        return input_ids, flat_positions, attn, sample_rows

    def _sampled_rows(self, batch: list[ScheduledRequest], sample_rows: list[tuple[int, int]],
                      attn: AttentionMetadata) -> None:
        """The last layer's view of a step with rows that do not sample (prefill chunks): past its KV write only the
        sampled rows matter, each attending over its whole sequence so far, as a decode does."""
        sampled = AttentionMetadata(slot_block=attn.slot_block[:0], slot_offset=attn.slot_offset[:0],
                                    num_decode_tokens=len(sample_rows))
        if sample_rows:
            ends = [batch[i].start_position + len(batch[i].token_ids) for i, _ in sample_rows]
            self._decode_tables(sampled, [batch[i].block_ids for i, _ in sample_rows], ends)
        attn.sampled_rows, attn.sampled = torch.tensor([r for _, r in sample_rows], dtype=torch.long), sampled

    def _prefill_tables(self, prefills: list[PrefillChunk], attn: AttentionMetadata) -> None:
        """The native prefill kernel's spans and padded block tables: every chunk of the step in one call."""
        max_blocks = max(len(c.block_ids) for c in prefills)
        tables = torch.zeros(len(prefills), max_blocks, dtype=torch.long)
        for i, chunk in enumerate(prefills):
            tables[i, :len(chunk.block_ids)] = chunk.block_ids
        attn.prefill_spans = torch.tensor([[c.start, c.end, c.num_context_tokens] for c in prefills])
        attn.prefill_tables, attn.prefill_kernel = tables, self.prefill_kernel

    def _decode_tables(self, attn: AttentionMetadata, block_ids: list[list[int]], lengths: list[int]) -> None:
        """The padded block table of the decodes (sequences of `lengths` tokens, their own included); the torch path
        also gets the padding's mask."""
        bs = self.block_size
        max_blocks = cdiv(max(lengths), bs)
        # Padded in Python and converted once: a tensor per row took 4x as long (0.5 ms a step at batch 64).
        rows = [ids[:cdiv(n, bs)] for ids, n in zip(block_ids, lengths, strict=True)]
        table = torch.tensor([row + [0] * (max_blocks - len(row)) for row in rows], dtype=torch.long)
        attn.decode_block_table, attn.decode_lengths = table, torch.tensor(lengths)
        attn.decode_kernel = self.decode_kernel
        if self.decode_kernel is None:
            visible = torch.arange(max_blocks * bs).unsqueeze(0) < attn.decode_lengths.unsqueeze(1)
            bias = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
            attn.decode_bias = bias.view(len(lengths), 1, 1, max_blocks * bs)
