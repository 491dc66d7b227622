"""The engine loop: admit requests, schedule a step, load hits, run the model, sample, save.

``LLMEngine`` is driven by ``step()``; ``LLM`` (engine/llm.py) wraps it for
offline generation and the serving processes drive it from their own loops.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_connector import StoreConnector
from engine.model_runner import ModelRunner, load_model_config
from engine.sampling import SampledTokens, Sampler, SamplingParams, TokenLogprobs, token_logprobs
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus
from engine.spec_decode import NgramDrafter
from engine.structured import Grammars
from engine.tokenizer import load_tokenizer
from kernels.host import to_device
from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_key, make_namespace


def model_identity(cfg: EngineConfig) -> str:
    """What distinguishes this model's weights, for chunk-key namespaces.

    Random presets: name, seed, and the kind of device when not the CPU (weights are
    drawn where the model runs). Folders: a digest of config.json and of each
    safetensors file's name, size, header and first and last MiB, so two
    checkpoints with the same config but other weights never share chunks.
    Either way, the ``hf_overrides`` (a cut or reshaped model is another model).
    """
    extra = json.dumps(cfg.hf_overrides, sort_keys=True, separators=(",", ":")) if cfg.hf_overrides else ""
    if cfg.model.startswith("random:"):
        device = cfg.torch_device().type
        return f"{cfg.model}:seed={cfg.seed}{'' if device == 'cpu' else '@' + device}{extra}"
    h = hashlib.blake2b(digest_size=16)
    with open(os.path.join(cfg.model, "config.json"), "rb") as f:
        h.update(f.read())
    for path in sorted(glob.glob(os.path.join(cfg.model, "*.safetensors"))):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return f"{os.path.basename(os.path.normpath(cfg.model))}:{h.hexdigest()}{extra}"


def _take_rows(logits, rows: list[int]):
    """``logits[rows]`` without the host waiting for the step's forward (a Python-list index is a
    pageable copy that does; ``to_device``)."""
    return logits.index_select(0, to_device(rows, torch.int64, logits.device))


@dataclass
class StepOutput:
    seq: Sequence
    token: int
    finished: bool
    logprobs: TokenLogprobs | None = None
    """With ``seq.params.logprobs``: the token's log-probability and its position's top tokens'."""


PENDING = -1
"""In ``seq.output``: the token a launched step is sampling, not yet on the host (async scheduling)."""


@dataclass
class _Launched:
    """A step launched with its sampled tokens left on the device (``async_scheduling``): its
    decodes and last prompt chunks sample one token each, other prompt chunks none."""

    sampled: SampledTokens
    entries: list[tuple[Sequence, int | None, int, int]]
    """Per sequence of the step: where its token goes in ``seq.output`` (a ``PENDING`` now; None
    when it samples none), and the positions the step computed (``seq.num_computed`` before and
    after it). The sampling ones in the order of ``sampled``'s rows."""
    rows: dict[int, int]
    """seq_id -> its row of ``sampled`` (the sequences that sample)."""


class LLMEngine:
    def __init__(self, cfg: EngineConfig, client=None) -> None:
        self.cfg = cfg
        device = cfg.torch_device()
        self._gpu: int | None = None
        """The engine's GPU (an index), made the current one of each thread that runs ``step`` (and
        of this one). Triton launches on the current GPU, and an event recorded without a stream
        records on its stream: with ``cuda:1`` and GPU 0 current, kernels would get GPU 1's pointers
        in GPU 0's context and events would not wait for the step."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self._gpu = torch.cuda.current_device()
        self.model_config = load_model_config(cfg.model, cfg.hf_overrides)
        self.runner = ModelRunner(cfg, self.model_config)
        self.blocks = BlockManager(self.runner.num_pages, cfg.page_size)
        self.scheduler = Scheduler(self.blocks, chunk_size=cfg.chunk_size,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_num_seqs=cfg.max_num_seqs, chunk_tokens=cfg.chunk_tokens,
                                   policy=cfg.scheduling_policy)
        self.tokenizer = load_tokenizer(cfg.model)
        mc = self.model_config
        self.fingerprint = ModelFingerprint(
            model_id=model_identity(cfg), dtype=str(self.runner.dtype).removeprefix("torch."),
            num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
            chunk_tokens=cfg.chunk_tokens)
        self._page_fp = ModelFingerprint(**{**{f: getattr(self.fingerprint, f) for f in self.fingerprint.__slots__},
                                            "chunk_tokens": cfg.page_size})
        self._page_hashes: dict[int, list[bytes]] = {}
        self._page_ns: dict[str | None, bytes] = {}
        self.connector: StoreConnector | None = None
        if cfg.store or cfg.conductor or cfg.etcd or client is not None:
            if client is None and (cfg.conductor or cfg.etcd):
                from kvstore.cluster import ClusterClient

                client = ClusterClient(cfg.conductor, local=cfg.store, timeout_s=30, transport=cfg.store_transport,
                                       etcd=cfg.etcd)
            elif client is None:
                from kvstore.client import StoreClient

                client = StoreClient(cfg.store, timeout_s=30, transport=cfg.store_transport)
            self.connector = StoreConnector(self.runner, client, self.fingerprint,
                                            save=cfg.save_to_store, load=cfg.load_from_store,
                                            load_batch=cfg.store_load_batch, stream_loads=cfg.stream_loads,
                                            land_direct=cfg.land_direct,
                                            save_buffers=cfg.store_save_buffers, check=cfg.chunk_check)
        self.eos = set(mc.eos_token_id)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos)
        self.sampler = Sampler(self.eos, self.grammars)
        self.seqs: dict[int, Sequence] = {}
        self.last_step_prefill_tokens: int | None = None
        """Prompt tokens the last step computed; None when it ran nothing (for the serving loop's metrics)."""
        self.last_step_seqs = 0
        """Sequences in the last step that ran, and their context tokens (a decode step's cost, for the conductor)."""
        self.last_step_context_tokens = 0
        self.num_generated = 0
        """Tokens sampled, and requests finished, since the engine started (P:D sizing's output lengths)."""
        self.num_finished = 0
        self.drafter = None
        if cfg.speculative == "ngram":
            from engine.spec_decode import NgramDrafter

            self.drafter = NgramDrafter(cfg.ngram_max, cfg.ngram_min, history=cfg.ngram_history)
        elif cfg.speculative == "draft":
            import dataclasses

            from engine.spec_decode import DraftModelDrafter

            draft_cfg = dataclasses.replace(cfg, model=cfg.draft_model, hf_overrides=cfg.draft_hf_overrides,
                                            num_pages=self.runner.num_pages, speculative="none", draft_model=None,
                                            draft_hf_overrides=None)
            dmc = load_model_config(draft_cfg.model, draft_cfg.hf_overrides)
            if dmc.vocab_size != mc.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({dmc.vocab_size}) is not the target's ({mc.vocab_size})")
            self.drafter = DraftModelDrafter(ModelRunner(draft_cfg, dmc))
        self.async_scheduling = cfg.async_scheduling
        """(``EngineConfig.async_scheduling``; may be switched between steps.)"""
        self._launched: _Launched | None = None
        """The step whose tokens are still on the device (async scheduling), or None."""
        self.num_overlapped_steps = 0
        """Steps launched before the tokens of the step before them were on the host."""
        self.num_spec_steps = 0
        """Sequence-steps that verified drafts; draft tokens verified, and of those accepted."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- requests -------------------------------------------------------------

    def add_request(self, prompt: list[int], params: SamplingParams, cache_salt: str | None = None,
                    output_prefix: list[int] | None = None, prefetched: dict | None = None,
                    replicate: bool = False, prefetch_skip: int = 0) -> Sequence:
        """Queues a request. Raises ValueError for an empty prompt, unknown token ids or too long a request.

        Args:
            output_prefix: tokens already generated elsewhere (the prefill
                engine's first token); generation continues after them.
            prefetched: chunk key → encoded chunk already fetched from the store
                (the decode engine fetches while the prefill engine still saves);
                its leading chunks count as store hits.
            prefetch_skip: leading chunks deliberately not prefetched because this
                engine's own pages held them (``local_prefix_chunks``).
        """
        self.validate(prompt, params)
        vocab = self.model_config.vocab_size
        if output_prefix and not all(isinstance(t, int) and 0 <= t < vocab for t in output_prefix):
            raise ValueError(f"output_prefix token ids must be in [0, {vocab})")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        seq = Sequence(list(prompt), params, cache_salt=cache_salt, output=list(output_prefix or []),
                       replicate=replicate)
        if self.connector is not None:
            if prefetched is not None:
                keys = self.connector.keys(seq.prompt, cache_salt)
                hits = min(prefetch_skip, len(keys))
                while hits < len(keys) and keys[hits] in prefetched:
                    hits += 1
                seq.store_hit_chunks = hits
                self.connector.stage(seq.seq_id, prefetched)
            else:
                seq.store_hit_chunks = self.connector.lookup(seq.prompt, cache_salt)
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError when a prompt and its longest output do not fit the model's context
        (a prefill engine checks the whole request with it: it computes only the first token)."""
        if prompt_tokens + max_tokens > self.model_config.max_position_embeddings:
            raise ValueError(f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds the model's "
                             f"context of {self.model_config.max_position_embeddings}")

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises ValueError, naming the problem, for a request this engine cannot serve."""
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt token ids must be integers")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self.check_context(len(prompt), params.max_tokens)
        if self.blocks.pages_for(len(prompt) + params.max_tokens) > self.blocks.num_pages:
            raise ValueError("the request does not fit the KV cache even alone (raise num_pages)")
        if any(t >= vocab for t in params.token_ids()):
            raise ValueError(f"token ids in the sampling parameters (stop_token_ids, logit_bias, "
                             f"allowed_token_ids, bad words) must be in [0, {vocab})")
        if params.min_tokens and params.allowed_token_ids is not None and all(
                params.is_stop(t, params.min_tokens + 1, self.eos) for t in params.allowed_token_ids):
            raise ValueError("every token of allowed_token_ids is a stop token, which min_tokens masks")
        if params.priority and not self.scheduler.by_priority:
            raise ValueError(f"priority {params.priority} asked of an engine that schedules first come, first served "
                             "(start it with --scheduling-policy priority)")
        if params.structured is not None:
            self.grammars.compile(params.structured)  # (cached: the engine's thread finds it compiled)

    def abort(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._forget(seq)
            while seq.output and seq.output[-1] == PENDING:  # a launched step's row of it is thrown away
                seq.output.pop()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None

    # ---- one step -------------------------------------------------------------

    def local_prefix_chunks(self, tokens: list[int], salt: str | None) -> int:
        """Leading full chunks of ``tokens`` whose pages this engine holds now (a hint for prefetching).

        Safe to call from another thread: it only reads the page index, and a
        stale answer costs a fetch (or a load at admission), never a wrong token.
        """
        if not self.cfg.enable_prefix_caching:
            return 0
        page = self.cfg.page_size
        ns = self._page_ns.get(salt) or make_namespace(self._page_fp, salt)
        cached, parent, n = self.blocks.cached, ROOT_KEY, 0
        for i in range((len(tokens) - 1) // page):
            parent = chunk_key(parent, ns, tokens[i * page : (i + 1) * page])
            if parent not in cached:
                break
            n += 1
        return n * page // self.cfg.chunk_tokens

    def _hashes(self, seq: Sequence, upto_pages: int) -> list[bytes]:
        """Chained page hashes of ``seq``'s first ``upto_pages`` full pages (cached)."""
        hs = self._page_hashes.setdefault(seq.seq_id, [])
        salt = seq.cache_salt
        ns = self._page_ns.get(salt)
        if ns is None:
            ns = self._page_ns[salt] = make_namespace(self._page_fp, salt)
        page = self.cfg.page_size
        upto_pages = min(upto_pages, seq.num_tokens // page)
        while len(hs) < upto_pages:
            i = len(hs)
            hs.append(chunk_key(hs[-1] if hs else ROOT_KEY, ns, seq.token_range(i * page, (i + 1) * page)))
        return hs[:upto_pages]

    def _draft(self) -> None:
        """Proposes speculative tokens for every decoding sequence that takes them."""
        k_max = self.cfg.num_speculative_tokens
        limit = self.model_config.max_position_embeddings
        wanted = []
        for seq in self.scheduler.running:
            seq.draft = []  # (one the budget left unscheduled last step is stale)
            # (a penalised request's logits depend on every token before: drafts would change them)
            if seq.num_tokens - seq.num_computed != 1 or not seq.params.speculable:
                continue
            # drafts past max_tokens or the context would be thrown away: the bonus token needs none
            k = min(k_max, seq.params.max_tokens - len(seq.output) - 1, limit - seq.num_tokens - 1)
            if k > 0:
                wanted.append((seq, k))
        if isinstance(self.drafter, NgramDrafter):
            for seq, k in wanted:
                seq.draft = self.drafter.propose(seq.tokens, k)
        else:
            fits = []  # a draft model writes its KV for the drafts into the sequence's pages: take them now
            for seq, k in wanted:
                need = self.blocks.pages_for(seq.num_tokens + k) - len(seq.pages)
                if need <= 0 or self.blocks.can_allocate(need):
                    seq.pages += self.blocks.allocate(need) if need > 0 else []
                    fits.append((seq, k))
            self.drafter.draft(fits)
        for seq, _ in wanted:  # a structured output's drafts, cut where its grammar stops allowing them
            if seq.params.structured is not None and seq.draft:
                seq.draft = self.sampler.valid_draft(seq.seq_id, seq.params, seq.output, seq.draft)

    def step(self) -> list[StepOutput]:
        """Runs one step; returns the tokens it sampled. With ``async_scheduling`` a step without
        drafts is launched and its tokens returned by the next call, which launches the next step
        first when nothing it schedules depends on them (``_overlap_skip``)."""
        if self._gpu is not None:
            torch.cuda.set_device(self._gpu)  # (the serving loop's thread is not the one that made the engine)
        done: list[StepOutput] = []
        skip = self._overlap_skip() if self._launched is not None else ()
        if skip is None:
            done = self._resolve()
            skip = ()
        if self.drafter is not None:
            self._draft()
        if self.cfg.enable_prefix_caching:
            out = self.scheduler.schedule(lambda s: self._hashes(s, s.num_tokens // self.cfg.page_size), skip)
        else:
            out = self.scheduler.schedule(lambda s: [], skip)
        scheduled = out.scheduled
        loads = []  # (seq, its load): the step computes while their KV lands, layer by layer
        try:
            if self.connector is not None:
                for seq in out.admitted:
                    if seq.num_store_tokens:
                        scheduled = self._begin_load(seq, scheduled, loads)
            if not scheduled:
                self.last_step_prefill_tokens = None
                return done + (self._resolve() if self._launched is not None else [])
            self.last_step_prefill_tokens = out.num_prefill_tokens
            self.last_step_seqs = len(scheduled)
            self.last_step_context_tokens = sum(s.seq.num_computed + s.num_new_tokens for s in scheduled)
            ready = None
            if loads:
                def ready(layer: int) -> None:
                    for _, pending in loads:
                        pending.wait_layer(layer)
            input_ids = None
            if self._launched is not None:  # its sequences decode the tokens launched for them
                self.num_overlapped_steps += 1
                rows = self._launched.rows
                first = [s for s in scheduled if s.seq.seq_id in rows]
                if first:  # (first in the step: the runner takes them as its first input ids)
                    if len(first) < len(scheduled):
                        scheduled = first + [s for s in scheduled if s.seq.seq_id not in rows]
                    input_ids = self._launched.sampled.rows([rows[s.seq.seq_id] for s in first])
            logits = self.runner.run(scheduled, kv_ready=ready, input_ids=input_ids)
        finally:
            rolled_back = self._finish_loads(loads)
        before = [s.seq.num_computed for s in scheduled]
        results: list[StepOutput] = []
        rows, params, ids, first_row, history = [], [], [], [], []
        row = 0
        for s in scheduled:
            seq = s.seq
            if id(seq) in rolled_back:  # computed over KV that failed its check: nothing of it counts
                first_row.append(None)
                row += s.num_rows
                continue
            first_row.append(row)
            if s.num_draft:  # verified below; its drafts' KV counts once accepted
                seq.num_computed += 1
            else:
                seq.num_computed += s.num_new_tokens
                if seq.num_computed == seq.num_tokens:
                    rows.append(row + s.num_rows - 1)
                    params.append(seq.params)
                    ids.append(seq.seq_id)
                    history.append((seq.prompt, seq.output) if seq.params.has_processors else None)
            row += s.num_rows
        if self.async_scheduling and rows and row == len(scheduled) and not rolled_back \
                and not any(s.all_rows for s in scheduled):  # a row a sequence (no drafts)
            return done + self._launch(scheduled, before, logits, rows, params, ids, history)
        if self._launched is not None:  # drafts verified, or a load rolled back
            done += self._resolve()
        sampled = {}  # row: (token, its TokenLogprobs or None)
        if rows:
            st = self.sampler.sample_async(_take_rows(logits, rows), params, ids, history)
            sampled = dict(zip(rows, zip(st.tolist(), st.logprobs())))
        now = time.perf_counter()
        for s, r, b in zip(scheduled, first_row, before):
            seq = s.seq
            if r is None or seq.status is SeqStatus.FINISHED:  # (ended by the tokens resolved above)
                continue
            if s.all_rows:
                self._prompt_logprobs(seq, logits[r:r + s.num_rows], b)
                r += s.num_rows - 1  # (the last row samples)
            if s.num_draft:
                new = self.sampler.verify(logits[r:r + 1 + s.num_draft], seq.draft, seq.params, seq.seq_id,
                                          (seq.prompt, seq.output))
                self.num_spec_steps += 1
                self.num_draft_tokens += s.num_draft
                self.num_accepted_tokens += len(new) - 1
                seq.num_draft_tokens += s.num_draft
                seq.num_accepted_tokens += len(new) - 1
                seq.draft = []
                lps = token_logprobs(logits[r:r + len(new)], new, seq.params.logprobs) \
                    if seq.params.logprobs is not None else [None] * len(new)
            elif r in sampled:
                new, lps = [sampled[r][0]], [sampled[r][1]]
            else:
                self._after_compute(seq, b)
                continue
            reason = None
            for n, (tok, lp) in enumerate(zip(new, lps), 1):
                seq.output.append(tok)
                if lp is not None:
                    seq.logprobs.append(lp)
                self.num_generated += 1
                reason = self._stop_reason(seq, tok, len(seq.output))
                if reason:
                    break
            new = new[:n]
            if s.num_draft:  # the accepted drafts' KV is in the pages; the rejected ones' is not counted
                seq.num_computed = seq.num_tokens - 1
                seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed)
                self._trim_pages(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._after_compute(seq, b)
            if reason:
                self._end(seq, reason, now)
            results += [StepOutput(seq, tok, reason is not None and j == len(new) - 1, lp)
                        for j, (tok, lp) in enumerate(zip(new, lps))]
        return done + results

    @staticmethod
    def _prompt_logprobs(seq: Sequence, logits, start: int) -> None:
        """Adds the log-probabilities of the prompt tokens that ``logits`` (one row per position
        from ``start``) predict: the row of position ``p`` predicts token ``p + 1``."""
        first = len(seq.prompt_logprobs)  # the next prompt token without them (a recompute repeats some)
        end = min(len(seq.prompt), start + len(logits) + 1)
        if first < end:
            seq.prompt_logprobs += token_logprobs(logits[first - 1 - start:end - 1 - start], seq.prompt[first:end],
                                                 seq.params.prompt_logprobs, ranks=True)

    def _stop_reason(self, seq: Sequence, tok: int, num_output: int) -> str | None:
        """Why ``seq`` ends with ``tok`` as its ``num_output``-th output token, or None."""
        if num_output >= seq.params.max_tokens:
            return "length"
        if seq.params.is_stop(tok, num_output, self.eos):
            return "stop"
        return None

    def _end(self, seq: Sequence, reason: str, now: float) -> None:
        self.num_finished += 1
        if isinstance(self.drafter, NgramDrafter):
            self.drafter.remember(seq.tokens)
        self.scheduler.finish(seq, reason)
        seq.finish_time = now
        self.seqs.pop(seq.seq_id, None)
        self._forget(seq)

    # ---- async scheduling: a step launched before the last one's tokens are known --------------

    def _launch(self, scheduled, before: list[int], logits, rows: list[int], params: list[SamplingParams],
                ids: list[int], history: list) -> list[StepOutput]:
        """Leaves the tokens of a step without drafts on the device (each sampling sequence's
        next token a ``PENDING``), then resolves the step launched before it: the host's work on
        those tokens runs while the device computes this one. The step's prompt chunks that
        sample nothing are saved and registered when it is resolved too. Returns the outputs of
        the step resolved."""
        sampled = self.sampler.sample_async(logits if len(rows) == len(scheduled) else _take_rows(logits, rows),
                                            params, ids, history)
        entries, where, sampling = [], {}, set(rows)  # (row b is sequence b's: no drafts)
        for b, (s, bef) in enumerate(zip(scheduled, before)):
            seq = s.seq
            at = None
            if b in sampling:
                where[seq.seq_id], at = len(where), len(seq.output)
                seq.output.append(PENDING)
            entries.append((seq, at, bef, bef + s.num_new_tokens))
        done = self._resolve() if self._launched is not None else []
        self._launched = _Launched(sampled, entries, where)
        return done

    def _overlap_skip(self) -> set[int] | None:
        """Whether the next step can be scheduled before the launched one's tokens are known, and
        if so the ids of the launched sequences it leaves out: those whose launched token is their
        last by length (``max_tokens``). The others decode once more (their input the launched
        tokens, on the device), running prompts go on with their next chunk and admissions follow:
        none of that depends on an unknown token. None (wait for the tokens) when drafts are
        proposed (they need the tokens), when a launched sequence has penalties or bad words of
        several tokens (its next logits depend on the launched token), when pages could run short (a preemption recomputes a sequence
        from its tokens), or when every running sequence ends and none waits."""
        launched, running = self._launched, self.scheduler.running
        if self.drafter is not None or not self.async_scheduling or not running:
            return None
        if any(s.params.needs_history for s, at, _, _ in launched.entries if at is not None):
            return None  # (its next logits' penalties or bans depend on the launched token)
        skip, need = set(), 0
        for seq in running:
            if seq.seq_id in launched.rows:  # next input: the launched token (a PENDING now)
                if len(seq.output) >= seq.params.max_tokens:
                    skip.add(seq.seq_id)
                    continue
                upto = seq.num_tokens
            else:  # a prompt's next chunk (at most), or a decode whose token is on the host
                upto = seq.num_computed + min(seq.num_tokens - seq.num_computed, self.cfg.chunk_size)
            need += max(0, self.blocks.pages_for(upto) - len(seq.pages))
        if (len(skip) == len(running) and not self.scheduler.waiting) or not self.blocks.can_allocate(need):
            return None
        return skip

    def _resolve(self) -> list[StepOutput]:
        """Waits for the launched step's tokens and does what a step does with its tokens. A
        sequence that ended (or was aborted) since has its row thrown away; one that ends now
        loses the ``PENDING`` of the step launched after it."""
        launched, self._launched = self._launched, None
        tokens = launched.sampled.tolist()
        logprobs = launched.sampled.logprobs()
        now = time.perf_counter()
        results = []
        row = 0
        for seq, at, before, upto in launched.entries:
            if at is None:  # a prompt chunk that samples nothing
                self._after_compute(seq, before, upto)
                continue
            tok, lp, row = tokens[row], logprobs[row], row + 1
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.output[at] = tok
            if lp is not None:
                seq.logprobs.append(lp)
            self.num_generated += 1
            reason = self._stop_reason(seq, tok, at + 1)
            if seq.first_token_time is None:
                seq.first_token_time = now
            # (that step computed positions before..upto-1; a step launched since may have more)
            self._after_compute(seq, before, upto)
            if reason:
                del seq.output[at + 1:]
                self._end(seq, reason, now)
            results.append(StepOutput(seq, tok, reason is not None, lp))
        return results

    def _trim_pages(self, seq: Sequence) -> None:
        """Frees the pages a verification took for drafts that were rejected."""
        extra = len(seq.pages) - self.blocks.pages_for(seq.num_tokens)
        if extra > 0:
            self.blocks.free(seq.pages[-extra:])
            seq.pages = seq.pages[:-extra]  # a new list: never shortened in place (Sequence.pages)

    def _begin_load(self, seq: Sequence, scheduled, loads: list):
        """Starts loading ``seq``'s store hits into its pages. Chunks that fail a check made now
        (a miss, a bad header, a store error) are recomputed from the first of them, starting
        next step; the rest land beside this step (``_finish_loads`` checks them after it)."""
        first = seq.num_local_tokens // self.cfg.chunk_tokens
        num = seq.num_store_tokens // self.cfg.chunk_tokens
        pending = self.connector.begin_load(seq.prompt, seq.cache_salt, seq.pages, first, num, seq_id=seq.seq_id,
                                            replicate=seq.replicate)
        loads.append((seq, pending))
        if pending.landed < num:  # a miss from here on: recompute, starting next step
            self._recompute_from(seq, first, pending.landed)
            scheduled = [s for s in scheduled if s.seq is not seq]
        return scheduled

    def _finish_loads(self, loads: list) -> set[int]:
        """After the step: every load's copies done and leases ended. A sequence whose chunk
        failed its check where it landed (or whose lease ran out before its copy ended) is
        rolled back to recompute from exactly that chunk; returns their ids (``id(seq)``)."""
        rolled_back: set[int] = set()
        error = None
        for seq, pending in loads:
            try:
                good = pending.finish()
            except Exception as exc:  # noqa: BLE001 - finish the others (their leases), then raise
                error, good = error or exc, 0
            first = seq.num_local_tokens // self.cfg.chunk_tokens
            if good < pending.landed:
                self._recompute_from(seq, first, good)
                rolled_back.add(id(seq))
            self._register_pages(seq, 0)
        if error is not None:
            raise error
        return rolled_back

    def _recompute_from(self, seq: Sequence, first: int, loaded: int) -> None:
        """``seq`` holds its local chunks and ``loaded`` store chunks after them; the rest is computed."""
        seq.num_computed = (first + loaded) * self.cfg.chunk_tokens
        seq.num_store_tokens = loaded * self.cfg.chunk_tokens
        seq.num_saved_chunks = first + loaded

    def _after_compute(self, seq: Sequence, before: int, upto: int | None = None) -> None:
        """Registers newly full pages locally and saves newly completed chunks to the store: those
        of positions ``before`` to ``upto`` (default ``seq.num_computed``)."""
        if seq.status is not SeqStatus.RUNNING:
            return
        upto = seq.num_computed if upto is None else upto
        self._register_pages(seq, before // self.cfg.page_size, upto)
        if self.connector is not None:
            done = upto // self.cfg.chunk_tokens
            if done > seq.num_saved_chunks:
                self.connector.save(seq.tokens, seq.cache_salt, seq.pages,
                                    seq.num_saved_chunks, done - seq.num_saved_chunks)
                seq.num_saved_chunks = done

    def _register_pages(self, seq: Sequence, first: int, upto: int | None = None) -> None:
        full = (seq.num_computed if upto is None else upto) // self.cfg.page_size
        if full <= first or not self.cfg.enable_prefix_caching:  # a decode step fills a page in 16
            return
        hashes = self._hashes(seq, full)
        for i in range(first, full):
            self.blocks.register(seq.pages[i], hashes[i])

    def _forget(self, seq: Sequence) -> None:
        self._page_hashes.pop(seq.seq_id, None)
        if self.connector is not None:
            self.connector.unstage(seq.seq_id)
        self.sampler.forget(seq.seq_id)

    def load(self):
        """The engine's load as the conductor's cost model wants it (no tensors)."""
        from kvstore.conductor.membership import EngineLoad

        sched = self.scheduler
        queued = sum(s.num_tokens - s.num_computed for s in sched.waiting)
        queued += sum(max(0, len(s.prompt) - s.num_computed) for s in sched.running)
        return EngineLoad(num_queued_tokens=queued, num_waiting=len(sched.waiting), num_running=len(sched.running),
                          num_context_tokens=sum(s.num_tokens for s in sched.running),
                          kv_usage=1.0 - self.blocks.num_free / self.blocks.num_pages,
                          num_generated_tokens=self.num_generated, num_finished=self.num_finished)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
