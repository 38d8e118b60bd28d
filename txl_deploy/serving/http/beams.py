"""Beam search on /v1/completions: the extension fields `num_beams`, `length_penalty` and `early_stopping`.

The search is `TxlRuntime.beam_search` (runtimes/beam_search.py, HuggingFace's `generate(num_beams=k,
do_sample=False)`): `max_tokens` is its max_new_tokens, `stop_token_ids` its stop (eos) ids, and `n` how many of
the best beams come back, best first, each with its `beam_score` (the sum of its log-probs over its length to the
power length_penalty). The local engine runs it on its loaded runtime, in its own thread between two steps, as one
call (`Scheduler.beam_search`): the k beams are k rows of that runtime's memory, not of the pool, and the running
streams wait until it is done. A Triton fleet has no beam search (its servers do not reorder memory rows): 400.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from txl_deploy.serving.http import protocol
from txl_deploy.serving.http.completion import prompt_decoder
from txl_deploy.serving.http.protocol import ApiError, CompletionRequest


async def answer(engine, ids, body: CompletionRequest, model: str, metrics) -> JSONResponse:
    """Run the request's beam search and answer with its best beams; 400 when the engine has none, or when it asks
    for more beams than --max-batch rows."""
    search = getattr(engine, "beam_search", None)
    if search is None:
        raise ApiError(400, "num_beams: beam search runs on the in-process engine, not over --triton",
                       param="num_beams")
    if body.num_beams > engine.max_batch:
        raise ApiError(400, f"num_beams {body.num_beams}: each beam is a row, and this server runs at most "
                            f"{engine.max_batch} at once (--max-batch)", param="num_beams")
    if not ids.size:
        raise ApiError(400, "the prompt is empty: a beam search starts from one", param="prompt")
    stop = tuple(body.stop_token_ids or ())
    beams = await run_in_threadpool(
        search, ids, num_beams=body.num_beams, max_new_tokens=body.max_tokens,
        length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
        early_stopping=False if body.early_stopping is None else body.early_stopping,
        num_return_sequences=body.n or 1, stop=stop)
    metrics.prompt_tokens.inc(int(ids.size))
    id_, generated, choices = protocol.new_id("cmpl"), sum(len(b.tokens) for b in beams), []
    usage = protocol.usage(int(ids.size), generated)
    for index, beam in enumerate(beams):
        ended = bool(beam.tokens) and beam.tokens[-1] in stop  # a stop id ends it, and its text is not sent
        decoder = prompt_decoder(engine.vocab, ids)
        text = "".join(decoder.feed(t) for t in beam.tokens[:len(beam.tokens) - ended]) + decoder.flush()
        one = protocol.completion(id_, model, text, "stop" if ended else "length", usage, None,
                                  list(beam.tokens) if body.return_token_ids else None, None, index=index)
        one["choices"][0]["beam_score"] = beam.score
        choices.append(one)
    tally = metrics.tally()
    for _ in range(generated):
        tally.token()
    tally.end(choices[0]["choices"][0]["finish_reason"])
    return JSONResponse(protocol.with_choices(choices))
