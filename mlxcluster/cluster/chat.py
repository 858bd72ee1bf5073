"""``mlxcluster chat``: an interactive multi-turn chat with a group's rank 0.

Each turn sends the whole conversation so far (``GenerateRequest.messages``: rank 0 renders it
through the model's chat template, :func:`mlxcluster.leader.generation.chat_messages`) and
streams the answer's text as it comes.  Commands: ``/reset`` forgets the conversation,
``/exit`` (or ``/quit``, or end of input: Ctrl-D) ends the session, ``/help`` lists them.
Ctrl-C during an answer ends that answer (the generation's gRPC stream is cancelled, so rank 0
stops decoding it) and keeps the session; the part already shown stays in the conversation.
Ctrl-C at the prompt only says how to quit.

The terminal is injected (:class:`ChatIO`), as is the call to rank 0 (``stream``), so the loop
is tested without a terminal or a group.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import grpc

from ..leader.generation import ClientError
from ..protocol import mlxcluster_pb2 as pb

__all__ = ["PROMPT", "ChatIO", "ChatSession", "HELP"]

#: What the session prints when it waits for the user's next message.
PROMPT = ">>> "

HELP = "/reset forgets the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"

#: ``stream(messages, max_tokens)``: the events of one generation of the conversation
#: ``messages`` (``(role, content)`` pairs), e.g. :meth:`GenerationClient.stream` with ``messages=``.
StreamFn = Callable[[Sequence[Tuple[str, str]], int], Iterator[pb.GenerateEvent]]


def _stdin_line(prompt: str) -> str:
    return input(prompt)


def _stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stderr_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@dataclass
class ChatIO:
    """The session's terminal.

    Attributes:
        read_line: ``read_line(prompt)`` -> the user's line, without its newline; raises
            ``EOFError`` at the end of input and ``KeyboardInterrupt`` on Ctrl-C (as ``input``).
        write: writes answer text as it streams (no newline added; flushed).
        notice: writes one line for the user (errors, notices), e.g. to stderr.
    """

    read_line: Callable[[str], str] = _stdin_line
    write: Callable[[str], None] = _stdout
    notice: Callable[[str], None] = _stderr_line


@dataclass
class ChatSession:
    """One chat: the conversation and the loop.

    Attributes:
        stream: the call to rank 0 (:data:`StreamFn`).
        max_tokens: the longest answer, in tokens (>= 1).
        io: the terminal (:class:`ChatIO`).
        messages: the conversation so far, ``(role, content)`` pairs (``user``/``assistant``;
            a system message is the caller's, added by rank 0 from the request).
    """

    stream: StreamFn
    max_tokens: int = 512
    io: ChatIO = field(default_factory=ChatIO)
    messages: List[Tuple[str, str]] = field(default_factory=list)

    def run(self) -> int:
        """Read messages and answer them until ``/exit`` or end of input.

        Returns:
            The exit status: 0 when the user quits, 1 when rank 0 fails (unreachable, its group
            failed): said in one line.  A request rank 0 refuses (``INVALID_ARGUMENT``, e.g. a
            conversation longer than the model's context) is one line too, and the session goes
            on without that message.
        """
        while True:
            try:
                line = self.io.read_line(PROMPT)
            except EOFError:
                self.io.write("\n")
                return 0
            except KeyboardInterrupt:
                self.io.write("\n")
                self.io.notice("(use /exit or Ctrl-D to quit)")
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0].lower()
                if command in ("/exit", "/quit", "/bye"):
                    return 0
                if command == "/reset":
                    self.messages.clear()
                    self.io.notice("(conversation reset)")
                elif command in ("/help", "/?"):
                    self.io.notice(HELP)
                else:
                    self.io.notice(f"unknown command {command[:40]}: {HELP}")
                continue
            status = self.turn(line)
            if status is not None:
                return status

    def turn(self, message: str) -> Optional[int]:
        """Answer ``message`` (streamed to ``io.write``); ``None`` to go on, else the exit status."""
        self.messages.append(("user", message))
        parts: List[str] = []
        try:
            for event in self.stream(list(self.messages), self.max_tokens):
                kind = event.WhichOneof("event")
                text = event.token.text if kind == "token" else event.done.text_tail if kind == "done" else ""
                if text:
                    parts.append(text)
                    self.io.write(text)
        except KeyboardInterrupt:  # the stream's generator cancelled the call on its way out
            self.io.write("\n")
            self.io.notice("(answer stopped)")
            self._answered(parts)
            return None
        except ClientError as exc:
            if parts:
                self.io.write("\n")
            self.messages.pop()  # not answered: the next message follows the previous answer
            self.io.notice(f"mlxcluster: error: {exc}")
            return None if exc.code == grpc.StatusCode.INVALID_ARGUMENT else 1
        self.io.write("\n")
        self._answered(parts)
        return None

    def _answered(self, parts: List[str]) -> None:
        """Keep the answer (as much of it as was shown) as the assistant's turn."""
        self.messages.append(("assistant", "".join(parts)))
