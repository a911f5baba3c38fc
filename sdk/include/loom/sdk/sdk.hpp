// Everything a plugin author needs, in one include.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/amp.hpp>
#include <loom/sdk/callback.hpp>
#include <loom/sdk/compat.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/error.hpp>
#include <loom/sdk/files.hpp>
#include <loom/sdk/fingerprint.hpp>
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/log.hpp>
#include <loom/sdk/memory_policy.hpp>
#include <loom/sdk/model.hpp>
#include <loom/sdk/optimizer.hpp>
#include <loom/sdk/options.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/plugin.hpp>
#include <loom/sdk/precision.hpp>
#include <loom/sdk/tensor_dataset.hpp>
#include <loom/sdk/types.hpp>
