"""One module per experiment of the chapter; each has a ``run(lm, out_dir, ...)`` that writes JSON
(and a PNG when matplotlib is available) and returns the numbers it wrote."""
