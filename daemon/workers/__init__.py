"""Worker processes: where the engines load and run, apart from the daemon
(docs/architecture.md, "Processes"). :mod:`.zygote` forks them, :mod:`.process` is their
side, :mod:`.channel` the control channel with tensors in shared memory, :mod:`.pool`
the daemon's side: which worker a model loads in, watching them, and the model proxy."""
