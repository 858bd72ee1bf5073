"""`mlxcluster chat`: the loop (mlxcluster.cluster.chat) with a fake terminal and a fake rank 0,
rank 0's rendering of a whole conversation (GenerateRequest.messages), and one run in a real
terminal (tmux) on the real model."""

import os
import shutil
import subprocess
import sys
import uuid
from types import SimpleNamespace

import grpc
import pytest

from harness import until
from mlxcluster.cluster.chat import PROMPT, ChatIO, ChatSession
from mlxcluster.leader.generation import ClientError, GenerationServicer, chat_messages
from mlxcluster.protocol import mlxcluster_pb2 as pb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def token(text):
    return pb.GenerateEvent(token=pb.GeneratedToken(token_id=1, text=text))


def done(tail=""):
    return pb.GenerateEvent(done=pb.GenerateDone(text_tail=tail))


class Terminal:
    """Lines to read (an exception instance is raised instead), everything written."""

    def __init__(self, *lines):
        self.lines = list(lines)
        self.out, self.notices, self.prompts = [], [], 0

    def read_line(self, prompt):
        assert prompt == PROMPT
        self.prompts += 1
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    def io(self):
        return ChatIO(read_line=self.read_line, write=self.out.append, notice=self.notices.append)

    @property
    def text(self):
        return "".join(self.out)


class Rank0:
    """A fake rank 0: records each conversation it is sent and answers from ``answers``
    (a list of events, or a callable(messages) -> iterator); ``closed`` counts streams closed
    before their end (a cancelled gRPC call)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.sent, self.closed = [], 0

    def __call__(self, messages, max_tokens):
        self.sent.append((list(messages), max_tokens))
        answer = self.answers.pop(0)
        return self._events(answer(messages) if callable(answer) else iter(answer))

    def _events(self, events):
        finished = False
        try:
            yield from events
            finished = True
        finally:
            if not finished:
                self.closed += 1


def test_each_turn_sends_the_whole_conversation_and_reset_forgets_it():
    term = Terminal("Hi, I am Ada.", "  ", "What is my name?", "/reset", "What is my name?", "/exit", "never read")
    rank0 = Rank0([token("Hello"), token(" Ada"), done("!")], [token("Ada."), done()], [done("I don't know.")])
    assert ChatSession(rank0, max_tokens=7, io=term.io()).run() == 0
    assert rank0.sent == [
        ([("user", "Hi, I am Ada.")], 7),
        ([("user", "Hi, I am Ada."), ("assistant", "Hello Ada!"), ("user", "What is my name?")], 7),
        ([("user", "What is my name?")], 7),
    ]
    assert term.text == "Hello Ada!\nAda.\nI don't know.\n"  # streamed piece by piece, a newline per answer
    assert term.notices == ["(conversation reset)"]
    assert term.lines == ["never read"]


def test_ctrl_c_stops_the_answer_not_the_session():
    def endless(messages):
        yield token("one")
        yield token(" two")
        raise KeyboardInterrupt  # Ctrl-C while the stream waits for the next token

    term = Terminal("count", "go on", KeyboardInterrupt(), "/quit")
    rank0 = Rank0(endless, [token("three"), done()])
    session = ChatSession(rank0, io=term.io())
    assert session.run() == 0
    assert rank0.closed == 1  # the first stream was closed, not drained
    assert "(answer stopped)" in term.notices and "(use /exit or Ctrl-D to quit)" in term.notices
    # the part shown stays in the conversation
    assert rank0.sent[1][0] == [("user", "count"), ("assistant", "one two"), ("user", "go on")]
    assert session.messages[-1] == ("assistant", "three")


def test_end_of_input_quits_and_errors_are_one_line():
    def refused(messages):
        raise ClientError("prompt of 9000 tokens exceeds the context of 8192", grpc.StatusCode.INVALID_ARGUMENT)
        yield  # pragma: no cover

    def failed(messages):
        yield token("par")
        raise ClientError("tensor-parallel group failed: rank 1 lost", grpc.StatusCode.UNAVAILABLE)

    term = Terminal("too long", "/bogus", "/help", "hello", "never read")
    session = ChatSession(Rank0(refused, failed), io=term.io())
    assert session.run() == 1  # rank 0's group failed: the session ends with its one line
    assert term.notices[0] == "mlxcluster: error: prompt of 9000 tokens exceeds the context of 8192"
    assert term.notices[1].startswith("unknown command /bogus: /reset")
    assert term.notices[3] == "mlxcluster: error: tensor-parallel group failed: rank 1 lost"
    assert session.messages == []  # neither unanswered message stays
    assert ChatSession(Rank0(), io=Terminal().io()).run() == 0  # Ctrl-D at once


def test_rank0_renders_the_conversation_through_the_chat_template(real_model_path):
    from mlxcluster.model.loader import load_tokenizer
    from mlxcluster.model.tokenizer import apply_chat_messages

    tokenizer, _ = load_tokenizer(real_model_path)
    servicer = GenerationServicer(None, SimpleNamespace(tokenizer=tokenizer), "none", "float32")
    turns = [("user", "Hi, I am Ada."), ("assistant", "Hello Ada!"), ("user", "What is my name?")]
    request = pb.GenerateRequest(system="Be brief.", messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])
    expected = apply_chat_messages(tokenizer, [{"role": "system", "content": "Be brief."}] +
                                   [{"role": r, "content": c} for r, c in turns])
    assert servicer._tokenize(request) == expected
    text = tokenizer.decode(expected)
    assert text.index("Hi, I am Ada.") < text.index("Hello Ada!") < text.index("What is my name?")
    for bad, words in ((dict(messages=[pb.ChatMessage(role="robot", content="x")]), r"messages\[0\]\.role must be one of"),
                       (dict(messages=[pb.ChatMessage(role="user", content="x"),
                                       pb.ChatMessage(role="assistant", content="y")]), "end with a user message"),
                       (dict(prompt="p", messages=[pb.ChatMessage(role="user", content="x")]), "not both")):
        with pytest.raises(ValueError, match=words):
            chat_messages(pb.GenerateRequest(**bad))


# -- in a real terminal ----------------------------------------------------------------------------

TMUX = shutil.which("tmux")


class Tmux:
    """A detached tmux session running one command in a 200x50 window."""

    def __init__(self, command):
        self.name = f"chat-{uuid.uuid4().hex[:8]}"
        subprocess.run([TMUX, "new-session", "-d", "-s", self.name, "-x", "200", "-y", "50", command], check=True)

    def send(self, *keys):
        subprocess.run([TMUX, "send-keys", "-t", self.name, *keys], check=True)

    def screen(self):
        out = subprocess.run([TMUX, "capture-pane", "-p", "-J", "-S", "-200", "-t", self.name],
                             capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else ""

    def alive(self):
        return subprocess.run([TMUX, "has-session", "-t", self.name], capture_output=True).returncode == 0

    def prompts(self):
        return sum(1 for line in self.screen().splitlines() if line.startswith(PROMPT.rstrip()))

    def wait_prompts(self, n, what, timeout=120):
        """Until the screen shows ``n`` prompt lines (the chat waits for input again)."""
        until(lambda: self.prompts() >= n and self.screen().rstrip().endswith(PROMPT.rstrip()), timeout,
              f"{what}\n{self.screen()}")

    def kill(self):
        subprocess.run([TMUX, "kill-session", "-t", self.name], capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_chat_in_a_real_terminal(tmp_path, real_model_path):
    """`mlxcluster chat` on the real model (TP=1) in tmux: an answer streams and the prompt comes
    back, /reset, a second message, Ctrl-C during an answer stops it and the session lives on,
    /exit ends it with status 0."""
    status = tmp_path / "status"
    log = tmp_path / "stderr"
    cmd = (f"cd {ROOT} && {sys.executable} -m mlxcluster chat --max-tokens 300 --weights float32 2>{log}; "
           f"echo $? > {status}")
    term = Tmux(f"bash -c '{cmd}'")
    try:
        term.wait_prompts(1, "the first prompt", 240)
        term.send("Say hello.", "Enter")
        term.wait_prompts(2, "the first answer and the prompt again")
        first = term.screen()
        answer = first.split("Say hello.", 1)[1].rsplit(PROMPT.rstrip(), 1)[0].strip()
        assert answer, first
        term.send("/reset", "Enter")
        until(lambda: "(conversation reset)" in log.read_text(), 30, "the reset notice")
        term.wait_prompts(3, "the prompt after /reset")
        # a long answer (300 tokens), stopped with Ctrl-C once it streams
        term.send("Write a long story about a dragon.", "Enter")
        until(lambda: len(term.screen().split("about a dragon.", 1)[-1].strip()) > 20, 120, "the answer streaming")
        term.send("C-c")
        until(lambda: "(answer stopped)" in log.read_text(), 30,
              lambda: f"the answer stopped (screen: {term.screen()[-600:]!r}; log: {log.read_text()[-600:]!r})")
        term.wait_prompts(4, "the prompt after Ctrl-C", 30)
        assert term.alive() and not status.exists()  # the session lives on
        assert "Traceback" not in log.read_text()
        term.send("Thank you.", "Enter")
        term.wait_prompts(5, "an answer after the stopped one")
        term.send("/exit", "Enter")
        until(lambda: status.exists() and status.read_text().strip() != "", 60, "chat to exit")
        assert status.read_text().strip() == "0", log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        term.kill()
