from largebatch.cli import run

run()
