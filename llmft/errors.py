"""The one base class of every problem llmft reports to a user as a single line.

Each layer keeps its own subclass (BatchError, DataError, CheckpointError, ...) so callers can catch what they
handle; commands catch `LlmftError` alone and print `llmft <command>: error: <message>` on rank 0, exit code 2
(llmft.command.report_error). Subclasses also keep their historical built-in base (ValueError, RuntimeError),
so code that catches those behaves as before."""


class LlmftError(Exception):
    """A problem with the user's input or environment, stated with its fix; never shown with a traceback."""


class TrainError(LlmftError, RuntimeError):
    """A run that cannot start, or a save that cannot be published; reported as one line and exit code 2."""
