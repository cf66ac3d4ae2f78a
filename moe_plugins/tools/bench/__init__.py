"""``moe-plugins bench``: side-by-side timing of MoE layers on an emulated multi-node cluster.

- :mod:`.matrix`: the typed plan (cases x rows x link rates) and its checks (pure);
- :mod:`.cluster`: network namespaces joined by tbf-shaped links (bring-up, rate changes, teardown);
- :mod:`.launch`: the rank processes, one per (node, local rank), bounded in time (:mod:`.rank_main` is
  their entry point);
- :mod:`.rows`: what a row is and how one is built: every schedule in the registry (``moe_plugins.plugins.default_registry()``)
  is a row, and so are the stock layers (:mod:`.stock_deepspeed`, :mod:`.stock_megatron` with the
  test/bench-only CPU shims of :mod:`.megatron_cpu_shims`);
- :mod:`.traffic`: inter-node bytes (ledger, counted collectives of stock layers, the NIC's counter);
- :mod:`.runner`: the rank side (interleaved timing, traffic, output agreement);
- :mod:`.report`: statistics, ratios, link lower bound, JSON, Markdown and PNG;
- :mod:`.harness`: the parent side that ties them together;
- the training-step contention bench (Lina, ``--preset lina``): :mod:`.lina_plan` (plan, rows, presets),
  :mod:`.lina_step` (rank side), :mod:`.lina_stats` (per-op all-to-all times, slowdowns, targets),
  :mod:`.lina_report` and :mod:`.lina_plots` (parent side and outputs);
- Lancet (#26): the ``lancet`` rows (:mod:`.rows`), the exposed all-to-all time of every timed step
  (:mod:`.lancet_exposure`), the judgement against the best fixed PipeMoE degree (:mod:`.lancet_report`), and the
  one-step timeline of ``benchmarks/lancet_timeline.py`` (:mod:`.lancet_step` rank side, :mod:`.lancet_timeline`
  parent side and picture); :mod:`.stats` holds the reports' shared pure helpers.

Nothing in the training path imports this package.
"""
