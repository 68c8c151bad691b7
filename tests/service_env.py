"""What the services a test starts (meshes, ``deepinfer up``, the serving benchmarks' smoke runs) get beside their
own settings, where the caller's ``DEEPINFER_*`` settings are not passed on."""

# one compile process per grammar service (the default is two): the second costs about 3.5 s of CPU at each start,
# which every mesh of the suite paid; the compile pool's own tests (tests/grammar) run two
GRAMMAR_WORKERS = "1"
