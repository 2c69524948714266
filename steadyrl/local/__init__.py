"""Processes on this machine: the embedded Kafka broker (`broker`, its jars and Java in `jars`,
a cluster of three in `cluster`), the supervisor that runs the stack's services, ports and
placement (CPU cores, GPUs), ACLs, the probe, the config check and `steadyrl up`'s stack."""
