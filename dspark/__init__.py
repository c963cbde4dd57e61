"""DSpark Serve: confidence-scheduled speculative decoding with a semi-autoregressive drafter.

The core library (no network code). See docs/design.md for the mathematics each module
implements; every module opens with the section it follows.
"""

__version__ = "0.1.0"
