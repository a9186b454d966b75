"""The contract: what a converted checkpoint is, as plain data on disk and typed objects in memory.

Everything else imports downward from here and nothing here imports the rest of preshard: dtypes, the
mesh, sharding styles, plans and their resolution, chunk and record layout, the manifest and its one
validator, torch.save record framing, the DCP `.metadata` writer and restricted reader, file I/O helpers.
"""
