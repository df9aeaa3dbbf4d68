"""General language-model pieces, below the engine, evaluation and RoE (which all use them).

``lm_head`` (the LM head on a few final hidden states at a time: no [T, V]), ``final_hidden`` (the
decoder's final hidden states, the head left to the caller), ``padding`` (left-padded batches),
``scored_tokens`` (``TokenScores``, what scoring a batch token by token returns). torch and
``moectl.errors`` only.
"""
