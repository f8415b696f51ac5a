"""The cluster commands: `accel-trainer config` (wizard.py), `check` (check.py) and `launch` (launch.py), with the
accelerate cluster configs they share (cluster_config.py) and the network probes (network.py).

They run before and around a run, never inside one: the training loop (the package root) does not import this
package (tests/test_architecture.py). Modules here may import the loop's (world, sharding, faults, ...).
"""
