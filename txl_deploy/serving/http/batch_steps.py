"""The steps of the engine's turn over its batch of running requests: admit, feed, sample, end.

A mixin of `Scheduler` (scheduler.py), which holds the rows (`rows`), the queue (`_waiting`), the batch
(`_running`) and the loop that calls these steps; docs/serving.md (how requests are batched) says what a turn does
and why the calls are cut as they are.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from txl_deploy.errors import TxlError
from txl_deploy.runtimes.lazy_decode import decide, full_log_probs
from txl_deploy.serving.http.completion import Completion, TokenOut
from txl_deploy.serving.http.echo import PromptEcho, scoring_chunk, scoring_rows
from txl_deploy.serving.http.engine import Job
from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.rows import PartialRun

logger = logging.getLogger(__name__)


class BatchSteps:
    """One turn's work on the batch; every method runs in the engine thread."""

    def _emit(self, job: Job, kind: str, payload):
        try:
            job.emit(kind, payload)
        except Exception:  # noqa: BLE001 - a client that cannot be told (its loop gone) must not stop the engine
            logger.exception("a request's event could not be delivered")
            job.cancelled = True

    def _cancelled(self, job: Job):
        if job in self._waiting:
            self._waiting.remove(job)
            self._dequeued()
            self._end(job, None)
        elif job in self._running and not job.finishing:
            if job.session is not None and job.pending is not None:
                job.finishing = True  # the session's memory takes the token already sampled (and sent)
            else:
                self._end(job, None)

    def _admit_waiting(self):
        """Waiting requests join the batch while fewer than max_batch rows run (a request with n or best_of takes
        that many rows once its prompt is read, and they are counted from its admission)."""
        while self._waiting and sum(j.choices for j in self._running) + self._waiting[0].choices <= self.max_batch:
            job = self._waiting.popleft()
            self._dequeued()
            try:
                if job.session is not None:
                    if job.session.handle is None:
                        job.session.handle = self.rows.start()
                    job.handle = job.session.handle
                else:
                    job.handle = self.rows.start()
                job.completion = Completion(job.params, self.vocab, self.n_token, context=job.prompt,
                                            clusters=self.clusters, grammar=job.followed_grammar())
                job.echoed = PromptEcho.of(job, self.vocab, None if job.session is None else
                                           job.session.last_log_probs)
            except Exception as e:  # noqa: BLE001 - this request fails; the engine checks it can go on
                self._fail(job, e)
                self._check()
                continue
            job.admitted = time.monotonic()
            self._running.append(job)
            if not job.prompt.size:  # a session continued without a prompt
                job.log_probs = job.session.last_log_probs
                if not self._ended_before_sampling(job):
                    self._sampled(job, job.completion.next, job.log_probs)

    def _run(self, jobs: list[Job], tokens: np.ndarray, positions: np.ndarray, head: bool = False):
        """One batched call: log-probs [B, P, V], or with head (hidden, head log-probs); None if it failed."""
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].handle if self.batched else 0)
        jobs[:] = [jobs[i] for i in order]
        try:
            log_probs = self.rows.run([j.handle for j in jobs], tokens[order], positions[order], head=head)
        except Exception as e:  # noqa: BLE001 - the call's requests fail; the engine checks it can go on
            # the backend commits nothing on failure, but a call over several spans may have run some of them
            committed = e.committed if isinstance(e, PartialRun) else []
            cause = e.__cause__ if isinstance(e, PartialRun) else e
            logger.error("a batched call failed", exc_info=cause)
            for i in committed:
                jobs[i].touched = True
                if jobs[i].session is not None:
                    jobs[i].session.tokens += tokens.shape[1]
            for job in jobs:
                self._fail(job, ApiError(500, f"the model failed on this batch: {type(cause).__name__}: {cause}",
                                         type="server_error", code="model_error"))
            self._check()
            return None
        for job in jobs:
            job.touched = True
        return log_probs

    def _decode(self):
        jobs = [j for j in self._running if j.pending is not None]
        if not jobs:
            return
        tokens = np.array([[j.pending] for j in jobs], dtype=np.int64)
        out = self._run(jobs, tokens, np.zeros((len(jobs), 1), dtype=np.int64), head=self.lazy)
        if out is None:
            return
        self.on_batch(len(jobs))
        deciding = []
        for i, job in enumerate(jobs):
            job.pending = None
            self._keep_last_position(job, out, i)
            if job.session is not None:
                job.session.tokens += 1
            if job.finishing:
                self._end(job, job.completion.finish)
            else:
                deciding.append(job)
        self._next_tokens(deciding)

    def _prefill(self):
        feeding = [j for j in self._running if j.prefilling and j.pending is None and not j.finishing]
        if not feeding:
            return
        # an echoed prompt with logprobs needs every position's full distribution: such rows are called apart, in
        # chunks whose [rows, tokens, V] block is bounded
        scoring = lambda j: j.echoed is not None and j.echoed.scoring  # noqa: E731
        scored_chunk = scoring_chunk(self.n_token, self.prefill_chunk)
        length = lambda j: min(scored_chunk if scoring(j) else self.prefill_chunk, j.prompt.size - j.fed)  # noqa: E731
        last = lambda j: j.fed + length(j) == j.prompt.size  # noqa: E731 (the prompt's last chunk)
        oldest = min(feeding, key=lambda j: j.admitted)
        q = length(oldest)
        if scoring(oldest):
            jobs = [j for j in feeding if scoring(j) and length(j) == q][:scoring_rows(self.n_token, q)]
            positions, head = np.broadcast_to(np.arange(q, dtype=np.int64), (len(jobs), q)), False
        else:
            head = self.lazy and last(oldest)
            # lazy: last chunks compute the head (the first decision's), the others the full graph, never in one call
            jobs = [j for j in feeding if not scoring(j) and length(j) == q
                    and (not self.lazy or last(j) == last(oldest))]
            positions = np.full((len(jobs), 1), q - 1, dtype=np.int64)
        tokens = np.stack([j.prompt[j.fed:j.fed + q] for j in jobs])
        out = self._run(jobs, tokens, np.ascontiguousarray(positions), head=head)
        if out is None:
            return
        deciding = []
        for i, job in enumerate(jobs):
            if scoring(job):
                job.echoed.chunk(out[i])
            job.fed += q
            if job.session is not None:
                job.session.tokens += q
            if not job.prefilling:
                self._keep_last_position(job, out, i)
                if job.echoed is not None:  # the prompt goes out before the first token
                    echoed, job.echoed = job.echoed, None
                    self._emit(job, "prompt", echoed.outs())
                deciding += self._forked_choices(job)
        self._next_tokens(deciding)

    def _forked_choices(self, job: Job) -> list[Job]:
        """The job and, with n or best_of, its other choices: rows that take copies of its memory, now that the
        prompt is read (once), and of its next distribution. [] if the fork failed (the request fails)."""
        if job.choices == 1 or job.cancelled:
            return [job]
        kids = [job.choice(i) for i in range(1, job.choices)]
        try:
            for kid in kids:
                kid.handle = self.rows.start()
            self.rows.copy(job.handle, [kid.handle for kid in kids])
            for kid in kids:
                kid.completion = Completion(kid.params, self.vocab, self.n_token, context=kid.prompt,
                                            clusters=self.clusters, grammar=kid.grammar)
        except Exception as e:  # noqa: BLE001 - this request fails; the engine checks it can go on
            for kid in kids:
                if kid.handle is not None:
                    self.rows.release(kid.handle)
                    kid.handle = None
            self._fail(job, e)
            self._check()
            return []
        job.choices = 1  # its rows are running now
        for kid in kids:
            kid.fed, kid.admitted, kid.touched = job.fed, job.admitted, True
            # copies: each choice's sampler works on its own
            kid.log_probs = None if job.log_probs is None else np.array(job.log_probs)
            kid.parts = None if job.parts is None else tuple(np.array(p) for p in job.parts)
            self._running.append(kid)
        return [job, *kids]

    @staticmethod
    def _keep_last_position(job: Job, out, i: int):
        """Keep row i of a call's result at its last position: log-probs, or lazily the (hidden, head) pair."""
        if isinstance(out, tuple):
            job.parts, job.log_probs = (out[0][i, -1], out[1][i, -1]), None
        else:
            job.parts, job.log_probs = None, out[i, -1]

    def _next_tokens(self, jobs: list[Job]):
        """Sample each job's next token (or finish it): on its log-probs, or for the jobs holding the head, one
        lazy decision over all of them."""
        lazy = []
        for job in jobs:
            if self._ended_before_sampling(job):
                continue
            if job.parts is None:
                self._sampled(job, job.completion.next, job.log_probs)
            else:
                lazy.append(job)
        if lazy:
            self._decide(lazy)

    def _decide(self, jobs: list[Job]):
        """The jobs' next tokens from their heads, each tail computed once for the rows whose decision needs it.
        A request whose sampling parameters leave no token fails alone; a failed tail fails the rows it was for."""
        refused = {}
        try:
            decision = decide(self.backend, [j.completion.sampler for j in jobs],
                              np.stack([j.parts[0] for j in jobs]), np.stack([j.parts[1] for j in jobs]),
                              failed=refused.__setitem__)
        except Exception as e:  # noqa: BLE001 - a tail graph failed: these requests fail, the engine goes on
            logger.error("a tail computation failed", exc_info=e)
            for job in jobs:
                self._fail(job, ApiError(500, f"the model failed on this batch: {type(e).__name__}: {e}",
                                         type="server_error", code="model_error"))
            self._check()
            return
        self.tail_stats["decisions"] += len(jobs) - len(refused)
        for i, rows in enumerate(decision.tail_rows):
            self.tail_stats["tails"][i] += int(rows)
        for r, job in enumerate(jobs):
            if r in refused:
                self._fail(job, refused[r])
                self._check()
            else:
                self._sampled(job, job.completion.decided, decision.choices[r])

    def _ended_before_sampling(self, job: Job) -> bool:
        """End the job instead of sampling if it was cancelled or is complete (max_tokens 0: only the prompt was
        fed)."""
        if job.cancelled:
            self._end(job, None)
            return True
        if job.completion.finish is not None:
            self._end(job, job.completion.finish)
            return True
        return False

    def _sampled(self, job: Job, choose, *args):
        """Send the token `choose(*args)` gives the job (or fail the job if it raises), and finish it if it was the
        last."""
        completion = job.completion
        try:
            out: TokenOut = choose(*args)
        except Exception as e:  # noqa: BLE001 - this request fails; the engine checks it can go on
            self._fail(job, e)
            self._check()
            return
        self._emit(job, "token", out)
        job.pending = out.token
        if completion.finish is not None:
            if job.session is not None:
                job.finishing = True  # fed at the next decode call, then done
            else:
                self._end(job, completion.finish)

    def _end(self, job: Job, finish_reason: str | None):
        self._release_job(job)
        if finish_reason is not None and not job.cancelled:
            self._emit(job, "done", {"finish_reason": finish_reason, "prompt_tokens": int(job.prompt.size),
                                     "completion_tokens": job.completion.generated})

    def _fail(self, job: Job, error: Exception):
        if not isinstance(error, ApiError):
            if isinstance(error, TxlError):
                error = ApiError(400, str(error))
            else:
                logger.error("a request failed", exc_info=error)
                error = internal_error(error, "this request failed")
        self._release_job(job)
        self._emit(job, "error", error)

    def _release_job(self, job: Job):
        """The job is over: out of the batch, its session free again, its own row back in the pool."""
        if job in self._running:
            self._running.remove(job)
        if job.session is not None:
            if job.touched:  # a request that never ran (cancelled or refused in the queue) leaves the session as it was
                complete = job.pending is None and not job.prefilling and (job.log_probs is not None or
                                                                           job.parts is not None)
                # the next-token log-probs of what the memory holds; a request cut short mid-prompt has none
                job.session.forget_next()
                if complete:
                    job.session.last_log_probs = self._next_log_probs(job)
                    job.session.grammar = job.completion.sampler.constraint
            self.sessions.release(job.session)
        elif job.handle is not None:
            self.rows.release(job.handle)
        job.handle = None

    def _next_log_probs(self, job: Job) -> np.ndarray | None:
        """The job's next-token log-probs [V] (float32): kept, or composed from the head and every tail."""
        if job.parts is None:
            return np.array(job.log_probs, dtype=np.float32)
        hidden, head = job.parts
        try:
            return full_log_probs(self.backend, hidden[None], head[None])[0]
        except Exception:  # noqa: BLE001 - the session keeps its memory; it then needs a prompt to go on
            logger.exception("a session's next-token distribution could not be computed")
            return None



def internal_error(error: BaseException, what: str) -> ApiError:
    return ApiError(500, f"{what}: internal error ({type(error).__name__}: {error})", type="server_error",
                    code="internal_error")
