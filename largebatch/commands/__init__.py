"""The commands wing: one module per `largebatch COMMAND` (`largebatch.cli.COMMANDS` maps names to them).

Commands parse arguments, start workers (through `largebatch.launch`), call the library and print; the library
(everything outside this package) never imports a command (tests/unit/test_layers.py).
"""
