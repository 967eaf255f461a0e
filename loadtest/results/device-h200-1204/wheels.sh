# Sourced by run.sh and diag.sh: install the carried wheels (.whl/, the packages the
# device image lacks) into /tmp/site and put them and the repository on PYTHONPATH.
# NO_WHL=1 skips them (a dry run on a machine that has everything).
if [ -d .whl ] && [ -z "${NO_WHL:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > /tmp/pip.txt 2>&1 || { cat /tmp/pip.txt; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
