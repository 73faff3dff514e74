"""Parallelism applied from outside the model: DeviceMesh, FSDP2, MoonEP expert parallelism, KDA context parallelism."""
