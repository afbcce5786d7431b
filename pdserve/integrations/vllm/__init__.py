"""PdConnector inside vLLM (`kv_connector_module_path: "pdserve.integrations.vllm"`). Only vLLM imports this
package: pdserve itself never needs vLLM installed."""

from pdserve.integrations.vllm.connector import PdConnector

__all__ = ["PdConnector"]
