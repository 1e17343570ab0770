"""Rows of a prompt file, JSONL (one object per line) or Parquet, read by index without holding the
file in memory: a JSONL file is indexed once (the byte offset of every row), a Parquet file is read
one row group at a time. Opening a file checks every row's prompt (present, of the right type, not
empty), so bad data is found before start-up, named by file and line (JSONL) or row (Parquet).

The prompt column (``data.prompt_key``) holds a string, or a chat: a list of ``{"role", "content"}``
messages. Every other column travels with the row (ground truth, data source, ...); verl's layout
(the ground truth under ``reward_model.ground_truth``) is read as ours.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron_rlhf.config.names import CHAT_ROLES

Prompt = Union[str, List[Dict[str, str]]]
AUTO_KEYS = ("prompt", "messages")  # what prompt_key None looks for


class RowFile:
    """The rows of one file: ``len()``, ``row(i)`` (a dict of every column) and ``where(i)``
    (``file:line`` or ``file: row i``, for messages). ``key`` is the prompt column."""

    path: str
    key: str

    def __len__(self) -> int:
        raise NotImplementedError

    def row(self, index: int) -> Dict[str, Any]:
        raise NotImplementedError

    def where(self, index: int) -> str:
        raise NotImplementedError

    def prompt_and_fields(self, index: int) -> Tuple[Prompt, Dict[str, Any]]:
        row = self.row(index)
        prompt = row.pop(self.key)
        return prompt, verl_fields(row, self.where(index))


def verl_fields(row: Dict[str, Any], where: str) -> Dict[str, Any]:
    """``row``'s columns, with verl's layout read as ours: the ground truth that verl's data
    preprocessing writes under ``reward_model.ground_truth`` is the row's ``ground_truth`` (the
    ``reward_model`` column travels on as it is); both given and different is refused."""
    nested = row.get("reward_model")
    if isinstance(nested, dict) and "ground_truth" in nested:
        if "ground_truth" in row and row["ground_truth"] != nested["ground_truth"]:
            raise ValueError(f"{where}: 'ground_truth' {row['ground_truth']!r:.60} and 'reward_model.ground_truth' "
                             f"{nested['ground_truth']!r:.60} differ; keep the one the reward should read")
        row.setdefault("ground_truth", nested["ground_truth"])
    return row


def open_rows(path: str, prompt_key: Optional[str], prompts: bool = True) -> RowFile:
    """The rows of ``path`` (Parquet by its magic bytes or extension, else JSONL), checked.
    ``prompts`` false: rows of another shape (the stages' pairs and chats), whose reader checks
    them; every row is still an object of valid JSON (JSONL) and the file has one."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1" or path.endswith((".parquet", ".pq")):
        return ParquetRows(path, prompt_key, prompts)
    return JsonlRows(path, prompt_key, prompts)


def _prompt_key(keys, prompt_key: Optional[str], where: str) -> str:
    """The prompt column of a row (or file) with columns ``keys``."""
    if prompt_key is not None:
        if prompt_key not in keys:
            raise ValueError(f"{where}: no {prompt_key!r} column (data.prompt_key); columns: {', '.join(sorted(keys))}")
        return prompt_key
    present = [k for k in AUTO_KEYS if k in keys]
    if len(present) == 2:
        raise ValueError(f"{where}: has both 'prompt' and 'messages'; set data.prompt_key to the one that holds the prompt")
    if not present:
        raise ValueError(f"{where}: no 'prompt' (a string) or 'messages' (a chat) column; columns: "
                         f"{', '.join(sorted(keys)) or 'none'} (data.prompt_key names another)")
    return present[0]


def as_messages(value: Any, role: str) -> List[Dict[str, str]]:
    """A string as one message of ``role``; messages as they are (a new list)."""
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def with_system_prompt(prompt: Prompt, system_prompt: Optional[str]) -> Prompt:
    """``prompt`` with ``system_prompt`` as a system message first (a string becomes a user message),
    unless the chat has one or there is none to add (data.system_prompt)."""
    if system_prompt is None:
        return prompt
    messages = as_messages(prompt, "user")
    return messages if messages[0]["role"] == "system" else [{"role": "system", "content": system_prompt}] + messages


def check_prompt(prompt: Any, key: str, where: str) -> None:
    """A non-empty string, or a non-empty list of chat messages: {"role": one of CHAT_ROLES,
    "content": str} (an assistant message with ``tool_calls`` may have no content, as OpenAI-style
    datasets write it); a bad message is named by its index."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: empty {key!r}; every row needs text to respond to")
        return
    if not isinstance(prompt, (list, tuple)) or not prompt:
        shown = json.dumps(prompt, default=str)[:80]
        raise ValueError(f"{where}: {key!r} must be a string or a list of {{\"role\": ..., \"content\": ...}} "
                         f"messages, got {shown}")
    for i, m in enumerate(prompt):
        problem = _message_problem(m)
        if problem:
            raise ValueError(f"{where}: {key!r} message {i}: {problem}: {json.dumps(m, default=str)[:200]}")


def _message_problem(m: Any) -> str:
    if not isinstance(m, dict):
        return "a message is an object with a role and a content"
    if m.get("role") not in CHAT_ROLES:
        return f"role {m.get('role')!r} is not one of {', '.join(CHAT_ROLES)}"
    content = m.get("content")
    if content is None and m["role"] == "assistant" and m.get("tool_calls"):
        return ""
    if not isinstance(content, str):
        return f"content must be a string (or null in an assistant message with tool_calls), got {type(content).__name__}"
    return ""


class JsonlRows(RowFile):
    def __init__(self, path: str, prompt_key: Optional[str], prompts: bool = True):
        self.path, self.offsets, self.lines = path, [], []
        self.key = prompt_key
        with open(path, "rb") as f:
            offset = 0
            for number, raw in enumerate(f, 1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                record = self._parse(raw, number)
                if prompts:
                    self._check_prompt(record, prompt_key, f"{path}:{number}")
                self.offsets.append(start)
                self.lines.append(number)
        if not self.offsets:
            raise ValueError(f"{path}: no {'prompts' if prompts else 'rows'} in the file")
        self._file = None

    def _check_prompt(self, record: Dict[str, Any], prompt_key: Optional[str], where: str) -> None:
        key = _prompt_key(record, prompt_key, where)
        if self.key is None:
            self.key = key
        elif key != self.key:
            raise ValueError(f"{where}: holds its prompt in {key!r}, earlier rows in {self.key!r}; one file, one "
                             "prompt column (data.prompt_key)")
        check_prompt(record[key], key, where)

    def _parse(self, raw: bytes, number: int) -> Dict[str, Any]:
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                             "is this a JSONL file?") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path}:{number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{self.path}:{number}: expected a JSON object, got {raw.strip()[:80].decode('utf-8', 'replace')}")
        return record

    def __len__(self) -> int:
        return len(self.offsets)

    def row(self, index: int) -> Dict[str, Any]:
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(self.offsets[index])
        return self._parse(self._file.readline(), self.lines[index])

    def where(self, index: int) -> str:
        return f"{self.path}:{self.lines[index]}"

    def __getstate__(self):  # deep copies (tests, dynamic sampling's replay) reopen the file
        return {**self.__dict__, "_file": None}


class ParquetRows(RowFile):
    def __init__(self, path: str, prompt_key: Optional[str], prompts: bool = True):
        import pyarrow.parquet as pq

        self.path = path
        try:
            self._parquet = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid and OSError kinds for files it cannot read
            raise ValueError(f"{path}: not a Parquet file ({type(e).__name__}: {e})") from None
        self.key = _prompt_key(self._parquet.schema_arrow.names, prompt_key, path) if prompts else None
        self.starts = [0]
        for group in range(self._parquet.num_row_groups):
            if not prompts:
                self.starts.append(self.starts[-1] + self._parquet.metadata.row_group(group).num_rows)
                continue
            column = self._row_group(group, [self.key])
            for i, prompt in enumerate(column):
                check_prompt(prompt, self.key, self.where(self.starts[-1] + i))
            self.starts.append(self.starts[-1] + len(column))
        if not len(self):
            raise ValueError(f"{path}: no {'prompts' if prompts else 'rows'} in the file")
        self._cached: Tuple[int, Optional[List[Dict[str, Any]]]] = (-1, None)

    def __len__(self) -> int:
        return self.starts[-1]

    def row(self, index: int) -> Dict[str, Any]:
        import bisect

        group = bisect.bisect_right(self.starts, index) - 1
        if self._cached[0] != group:
            self._cached = (group, self._row_group(group))
        return dict(self._cached[1][index - self.starts[group]])

    def _row_group(self, group: int, columns: Optional[List[str]] = None):
        """Row group ``group`` as rows (or ``columns``' values); an unreadable one named with the file."""
        try:
            table = self._parquet.read_row_group(group, columns=columns)
        except Exception as e:  # pyarrow's ArrowInvalid / OSError kinds for damaged data
            first = self.starts[group] + 1 if group < len(self.starts) else "?"
            raise ValueError(f"{self.path}: row group {group} (from row {first}) cannot be read ({type(e).__name__}: "
                             f"{e}); the file is damaged") from None
        return table.column(0).to_pylist() if columns else table.to_pylist()

    def where(self, index: int) -> str:
        return f"{self.path}: row {index + 1}"

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_parquet")
        state["_cached"] = (-1, None)
        return state

    def __setstate__(self, state):
        import pyarrow.parquet as pq

        self.__dict__.update(state)
        self._parquet = pq.ParquetFile(self.path)


def row_tools(value: Any) -> Optional[List[Any]]:
    """A row's ``tools`` column: function specs (a list of objects) the template shows besides the
    run's, or the names of the run's tools (rollout.tools) the row may use, the only ones shown;
    either as its JSON text. None without one."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"its 'tools' column is not valid JSON ({e.msg})") from None
    if not isinstance(value, list) or not (all(isinstance(t, dict) for t in value) or
                                           all(isinstance(t, str) for t in value)):
        raise ValueError(f"its 'tools' column must be a list of function specs or of the run's tool names, got "
                         f"{json.dumps(value, default=str)[:80]}")
    return value


def named_tools(column: Optional[List[Any]]) -> Optional[List[str]]:
    """The run's tools a row's ``tools`` column (row_tools) restricts it to: the names it lists, none
    for an empty list (a row without tools); None where the row is not restricted (no column, or
    specs to show besides the run's)."""
    if column is None or (column and isinstance(column[0], dict)):
        return None
    return list(column)
