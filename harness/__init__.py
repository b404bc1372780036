"""Test, benchmark and demo harness around the SGLang plugin (not part of the plugin).

- `harness.demo`: `make demo` (`python -m harness.demo --help`), stock SGLang vs SGLang +
  `compactor serve` on a shared-document workload.
- `harness.launch`: starts and stops real server processes (`SGLangServer`,
  `CompactorService`) for the tests, the benchmarks and the demo.
- `harness.workload`: the shared needle documents, their questions, and clients for a live
  server; `harness.forced`: answers scored teacher-forced on one, and compared.
- `harness.pd`: a prefill/decode pair behind sglang-router on CPU, and scoring through it.
- `harness.provenance`: what produced a result file (command, commit, machine, date).

The plugin (`sglang_ext`) never imports this package; importing it has no side effects.
"""
