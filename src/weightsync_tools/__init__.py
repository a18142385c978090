"""Tooling beside the weightsync library, shipped in the same distribution.

    bench/   what `weightsync bench` measures (the sync suite)
    faults/  fault injection and load under pushes (`weightsync bench --suite faults`,
             and the rig tests/faults drives)
    demo/    the RL loop behind `weightsync demo`

Needs the `tools` extra (matplotlib, tqdm): `pip install 'weightsync[tools]'`. The
library never imports this package; `weightsync.cli` does, lazily, for the
subcommands above. Importing this package imports none of its modules.
"""
