"""Helix parallelism (arXiv 2507.07120): the GQA half of decode context parallelism.

N = KVP x TPA ranks form the TP group, ``tp_rank = tpa_rank * KVP + kvp_rank``; the KVP group is a
DCP group of size KVP (``parallel_state.dcp_group_ranks``). Each KVP rank keeps the KV of the
tokens it owns, laid out as DCP's with ``interleave_size = chunk`` (``kv_layout``), computes partial
attention of its TPA heads over them (``attention``, ``decode_state``), and DCP's All-to-All + LSE
combine (``dcp_a2a_lse_reduce``) turns the partials into exact attention for its ``Q/N`` heads:
the head slice its ``o_proj`` row shard expects.
"""
