"""HuggingFace's own beam search (`generate(num_beams=k, do_sample=False)`, transformers 4.56) on its TransfoXL.

Two things stop 4.56's `generate` from driving the deprecated `TransfoXLLMHeadModel` as shipped, and both are
bookkeeping, not arithmetic:
- since transformers 4.50 `PreTrainedModel` no longer inherits `GenerationMixin`, and the deprecated class was not
  given it back: the model has no `generate` (AttributeError);
- `generate` then starts an empty `DynamicCache` for every model that does not opt out, and TransfoXL's
  `prepare_inputs_for_generation` passes it as `mems`, where `mems[0].size(0)` fails (a cache layer is a tuple).
`benchmarks.peer_huggingface.with_generate` gives the model a class with `GenerationMixin` that opts out of the
default cache (as 4.56 does for xlnet and reformer, the other models with a `mems`-style cache), for this oracle and
the beam-search benchmark alike. `generate` then runs its unchanged `_beam_search`:
the model's `mems` output is its cache (`_update_model_kwargs_for_generation` maps `mems` to `past_key_values`),
reordered every step by TransfoXL's own `_reorder_cache`. Its first memory is HF's default, mem_len zero vectors
that are attended to (`TxlRuntime.start_from_zero_memory` reproduces it).
"""

from __future__ import annotations


def hf_beams(model, prompt, num_beams, max_new_tokens, length_penalty, early_stopping, num_return_sequences,
             stop):
    """HF's returned sequences as (generated ids, sequences_scores[i]) best first, padding cut by beam_indices."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=num_beams, do_sample=False,
                             max_new_tokens=max_new_tokens, num_return_sequences=num_return_sequences,
                             length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=stop,
                             pad_token_id=model.config.vocab_size - 1, output_scores=True,
                             return_dict_in_generate=True)
    lengths = (out.beam_indices != -1).sum(dim=1)  # -1 past each hypothesis' end
    return [(out.sequences[i, len(prompt):len(prompt) + int(lengths[i])].tolist(), float(out.sequences_scores[i]))
            for i in range(num_return_sequences)]
