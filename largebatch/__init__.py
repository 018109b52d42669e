"""largebatch: large-minibatch data-parallel training of image classifiers."""

__version__ = "0.1.0"
