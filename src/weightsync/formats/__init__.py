"""The formats both ends of a push share: the HTTP bucket frame (`wire`), the disk version
directory (`version_dir`), SGLang-shaped weight-update groups (`groups`) and buckets in shares
(`shares`). Each is written once, for the trainer and the engine side; it imports only the
core (records, digests, integrity, hosts): never a transport, an engine, the server or `push`.
"""
