"""Helix parallelism (arXiv 2507.07120): KV-parallel (KVP) x attention-TP (TPA) decode.

N = KVP x TPA ranks form the TP group, ``tp_rank = tpa_rank * KVP + kvp_rank``. Each KVP rank keeps
only the KV of the tokens it owns (``ownership``) and computes partial attention over them; one
All-to-All over the KVP group plus an LSE merge (``comm``) turns the partials into exact attention
for the rank's ``Q/N`` query heads, which is the head slice its ``o_proj`` row shard expects.
"""
