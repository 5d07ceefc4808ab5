"""YAML as slurm-ext reads its files (models, clusters, the daemon's config): PyYAML's safe
loader, except that a key given twice in one mapping is an error. PyYAML keeps the last
one silently, so ``hidden: 1024`` followed by ``hidden: 2048`` would be a model of 2,048
without a word."""

import yaml
from yaml.constructor import ConstructorError
from yaml.resolver import BaseResolver


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing repeated mapping keys."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *defaults" may repeat keys on purpose
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            repeated = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key: the safe loader's own error follows
            continue
        if repeated:
            raise ConstructorError("while reading a mapping", node.start_mark,
                                   f"the key {key!r} is given twice", key_node.start_mark)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str) -> object:
    """The document in ``text`` (None when empty).

    Raises:
        yaml.YAMLError: malformed, nested too deeply, or a key given twice in one mapping.
    """
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:  # "[[[[…" thousands deep: a YAMLError like any other malformed file
        raise yaml.YAMLError("nested too deeply") from None
