"""Everything a GPU serving run could fail on that a CPU can check (`run`): the imports a GPU
machine would miss (`kernels`, through fresh interpreters: `probe`) and the FlashInfer bundle
the wheelhouse carries (`flashinfer`)."""
