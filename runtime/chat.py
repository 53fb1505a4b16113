"""A chat request's messages as vLLM's chat requests hand them to the chat template.

Two things depend on the template:
- Whether it takes a message's content as OpenAI's list of text parts (it loops over them
  itself, as Gemma 3's, Llama 4's and Mistral Small 3.1's do) or as one string (the parts
  joined by newlines). vLLM reads this off the template's syntax tree; so do we, by its rule:
  a loop over a message's content, where a message is a loop variable over `messages` (or a
  name set from it); over a macro parameter some call passes a message's content to; or,
  outside macros, over a name that is literally `content`.
- Whether it knows the `developer` role (OpenAI's newer name for system instructions): where
  its text never names it, developer messages become system messages, and every system
  message is merged into one at the front, as vLLM does (templates such as Qwen's take a
  system message first only).
"""

from jinja2 import TemplateSyntaxError, nodes
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from runtime.request import content_text, content_texts


class ChatRules:
    """How one tokenizer's chat template wants its messages."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        template = tokenizer.chat_template
        if isinstance(template, dict):  # named templates: apply_chat_template renders "default"
            template = template.get("default")
        if not isinstance(template, str):
            template = ""  # no template: apply_chat_template refuses the request anyway
        self.takes_parts = _loops_over_content(template)
        self.knows_developer = '"developer"' in template or "'developer'" in template

    def conversation(self, messages: list[dict]) -> list[dict]:
        """The messages (each's content a string or a non-empty list of text parts) as the
        template is given them; the caller's are left as they are."""
        if self.takes_parts:
            messages = [{**m, "content": [{"type": "text", "text": t} for t in content_texts(m["content"])]}
                        for m in messages]
        else:  # the texts joined by newlines; an empty part adds no line (vLLM drops it)
            messages = [{**m, "content": "\n".join(text for text in content_texts(m["content"]) if text)}
                        for m in messages]
        if self.knows_developer or not any(m["role"] == "developer" for m in messages):
            return messages
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
        if systems in ([], [0]):
            return messages
        texts = [content_text(messages[i]["content"]) for i in systems]
        merged = {"role": "system", "content": "\n\n".join(text for text in texts if text)}
        return [merged, *(m for m in messages if m["role"] != "system")]


class _Unreadable(Exception):
    """A template shape vLLM's reading gives up on (a name it binds is no plain name): then it
    takes the content as a string."""


def _loops_over_content(template: str) -> bool:
    try:
        tree = _compile_jinja_template(template).environment.parse(template)
    except TemplateSyntaxError:  # apply_chat_template cannot render it either: an error row
        return False
    try:
        return _finds_content_loop(tree)
    except _Unreadable:
        return False


def _finds_content_loop(tree: nodes.Template) -> bool:
    message_lists = _names_set_from(tree, "messages")
    messages = {_plain_name(loop.target) for loop in tree.find_all(nodes.For)
                if _reads_name(loop.iter, message_lists)}
    # The loops inside macros, and for each the parameters its macro is given a content in (an
    # inner macro's, where it has any: find_all visits outer macros first).
    in_macros, params_by_loop = set(), {}
    for macro in tree.find_all(nodes.Macro):
        params = _params_given_content(tree, macro, messages)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in tree.find_all(nodes.For):
        if _reads_content(loop.iter, messages):
            _plain_name(loop.target)
            return True
        if isinstance(loop.iter, nodes.Name) and (
                loop.iter.name in params_by_loop.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            _plain_name(loop.target)
            return True
    return False


def _plain_name(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):  # `{% set ns.x = ... %}`, `{% for a, b in ... %}`
        raise _Unreadable
    return target.name


def _through(node: nodes.Node) -> nodes.Node:
    """The expression under filters, tests and slices: `messages[1:] | reverse` reads `messages`."""
    while ((isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None)
           or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice))):
        node = node.node
    return node


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _reads_name(node: nodes.Node, names: set[str]) -> bool:
    return _is_name(_through(node), names)


def _reads_content(node: nodes.Node, messages: set[str]) -> bool:
    """`m['content']` or `m.content` (through filters, tests and slices), m a message."""
    node = _through(node)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content" and _is_name(node.node, messages)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and _is_name(node.node, messages)
    return False


def _names_set_from(tree: nodes.Template, name: str) -> set[str]:
    """`name` and the names set from it, or from a name so set (`{% set loop_messages =
    messages[1:] %}`). Scopes are not told apart (nor are they by vLLM)."""
    names = {name}
    while True:
        found = {_plain_name(assign.target) for assign in tree.find_all(nodes.Assign)
                 if _reads_name(assign.node, names)}
        if found <= names:
            return names
        names |= found


def _params_given_content(tree: nodes.Template, macro: nodes.Macro, messages: set[str]) -> set[str]:
    """The macro's parameters that some call of it passes a message's content to."""
    params = [arg.name for arg in macro.args]
    given = set()
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
            given.update(name for name, arg in zip(params, call.args) if _reads_content(arg, messages))
            given.update(kw.key for kw in call.kwargs if kw.key in params and _reads_content(kw.value, messages))
    return given
