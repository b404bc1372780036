"""Scripts that measure the project, grouped by what they need; each writes its figures to
`benchmarks/results/` (JSON, often a PNG beside it) with the command, commit, machine and date
inside (`harness.provenance`). Run them from the repository root with `python -m`:

- `offline/`: a CPU and the embedded model, no server;
- `server/`: real SGLang servers (and `compactor serve`) started on loopback;
- `gpu/`: a CUDA machine, and the tools that prepare a run there without network;
- `report/`: the documents' tables rendered from the result files, and `run_all`.

`benchmarks/README.md` maps each script to its result files and the document that shows them.
"""

from harness.provenance import ROOT

RESULTS = ROOT / "benchmarks" / "results"

__all__ = ["RESULTS", "ROOT"]
