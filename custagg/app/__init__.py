"""The application around the library: the main job `python -m custagg`.

* `custagg.app.cli`: the command line (flags, errors, dispatch);
* `custagg.app.train`: the training loop and the final check;
* `custagg.app.models`: the TF1 tutorial models;
* `custagg.app.datasets`: MNIST on disk, else scikit-learn's digits;
* `custagg.app.quiet`: TensorFlow without its start-up log lines;
* `custagg.app.cluster`: `--distributed local`, a ps and workers as local
  processes (`custagg.app.cluster_job`: one task's code).

The library (everything in `custagg/` outside this package) never imports
it. Importing this package imports nothing else, TensorFlow included.
"""
