"""A cluster on one machine: hosts (network, mount and PID namespaces) that share nothing but the
network, running rlmill's services the way separate machines would. See __main__ for the commands
and docs/guide/cluster.md for what each host runs."""
