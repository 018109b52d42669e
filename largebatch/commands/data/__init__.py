"""`largebatch data ...`: one module per subcommand, named after its word (`data pack`: pack.py, `data index`:
index.py); the library they call is largebatch/data/ (pack.py, wds.py)."""
